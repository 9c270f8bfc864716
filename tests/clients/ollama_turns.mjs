// ollama-js against a server (argv: HOST KEY MODEL SCHEMA_JSON): a chat, a stream, a tool
// turn with its result sent back, a JSON-schema `format`, /api/tags, /api/ps, /api/show,
// /api/version, a wrong-type body and an unknown route; prints what came back as JSON.
import { Ollama } from "ollama";

const [host, key, model, schemaText] = process.argv.slice(2);
const ollama = new Ollama({ host, headers: { Authorization: `Bearer ${key}` } });
const options = { temperature: 0, num_predict: 8 };
const out = {};

out.chat = await ollama.chat({ model, messages: [{ role: "user", content: "Say hello." }], options });
const parts = [];
for await (const part of await ollama.chat({ model, messages: [{ role: "user", content: "Say hello." }], options,
                                              stream: true })) {
  parts.push(part);
}
out.stream = parts;

const tools = [{ type: "function", function: { name: "get_weather", description: "Weather in a city",
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } }];
const ask = { role: "user", content: "What is the weather in the secret note city?" };
const call = await ollama.chat({ model, messages: [ask], tools, options: { temperature: 0, num_predict: 200 } });
out.call = call;
const result = { role: "tool", content: "11 degrees celsius", tool_name: "get_weather" };
out.after = await ollama.chat({ model, messages: [ask, call.message, result], tools, options });

out.format = await ollama.chat({ model, messages: [{ role: "user", content: "Answer in JSON." }],
                                 format: JSON.parse(schemaText), options: { temperature: 0, num_predict: 60 } });
out.tags = await ollama.list();
out.ps = await ollama.ps();
out.show = await ollama.show({ model });
out.version = await ollama.version();

async function failure(fn) {
  try {
    await fn();
    return null;
  } catch (error) {
    return { name: error.name, message: String(error.message), status: error.status_code };
  }
}
out.wrongType = await failure(() => ollama.chat({ model, messages: [{ role: "user", content: 5 }] }));
out.unknownRoute = await failure(() => ollama.embed({ model, input: "text" }));
console.log(JSON.stringify(out));

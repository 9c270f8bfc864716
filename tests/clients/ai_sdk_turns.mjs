// Two turns of the Vercel AI SDK's generateText (argv: PROVIDER BASE_URL KEY MODEL FILE,
// PROVIDER openai-compatible or anthropic): a plain one, then a two-step loop whose tool
// reads a file; prints the replies as JSON.
import { readFileSync } from "node:fs";
import { createAnthropic } from "@ai-sdk/anthropic";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateText, jsonSchema, stepCountIs, tool } from "ai";

const [provider, baseURL, apiKey, modelName, note] = process.argv.slice(2);

function languageModel() {
  if (provider === "anthropic") return createAnthropic({ baseURL, apiKey })(modelName);
  return createOpenAICompatible({ name: "monolith", baseURL, apiKey })(modelName);
}

const readNote = tool({
  description: "Read the note called `name` and return its text.",
  inputSchema: jsonSchema({ type: "object", properties: { name: { type: "string" } }, required: ["name"] }),
  execute: async () => readFileSync(note, "utf8"),
});

const model = languageModel();
const messages = [{ role: "user", content: "Say hello." }];
const first = await generateText({ model, messages, maxOutputTokens: 64, maxRetries: 0 });
messages.push(...first.response.messages);
messages.push({ role: "user", content: "Read the secret note with read_note and tell me what it says." });
const second = await generateText({
  model, messages, tools: { read_note: readNote }, stopWhen: stepCountIs(2), maxOutputTokens: 64, maxRetries: 0,
});
const toolResults = second.steps.flatMap((step) => step.toolResults);
console.log(JSON.stringify({ replies: [first.text, second.text], tools: toolResults.map((r) => r.toolName) }));

// Talking to the server: the API key (kept in localStorage, asked for on a 401), the
// streamed chat request, Server-Sent Events, and whether this server streams the
// speculation extension (`monolith.spec`, docs/serving.md "The chat page").

const KEY_ITEM = "monolith.apiKey";
let askForKey = async () => null; // set by the page: resolves to a key typed by the user, or null
let specSupported = null; // null: not known yet; then true or false for this page's life

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function onKeyNeeded(ask) {
  askForKey = ask;
}

export function forgetKey() {
  localStorage.removeItem(KEY_ITEM);
}

function headers(extra = {}) {
  const key = localStorage.getItem(KEY_ITEM);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// fetch with the key; on a 401 ask for a key (once a call) and try again
async function authorized(path, init) {
  let response = await fetch(path, { ...init, headers: headers(init.headers) });
  if (response.status === 401) {
    const key = await askForKey();
    if (key) {
      localStorage.setItem(KEY_ITEM, key);
      response = await fetch(path, { ...init, headers: headers(init.headers) });
    }
  }
  return response;
}

async function errorOf(response) {
  const text = await response.text();
  try {
    const error = JSON.parse(text).error || {};
    return { message: error.message || text, param: error.param || "" };
  } catch {
    return { message: text || response.statusText, param: "" };
  }
}

export async function getText(path) {
  const response = await authorized(path, { method: "GET" });
  if (!response.ok) throw new HttpError(response.status, (await errorOf(response)).message);
  return response.text();
}

export async function getJSON(path) {
  return JSON.parse(await getText(path));
}

function postJSON(path, body, signal) {
  return authorized(path, {
    method: "POST", signal, body: JSON.stringify(body), headers: { "Content-Type": "application/json" },
  });
}

// A server without the extension refuses the field with a 400 naming it: then the
// request goes again without it, and later ones leave it out.
async function postChat(body, signal) {
  const { monolith, ...plain } = body;
  if (specSupported === false) return postJSON("/v1/chat/completions", plain, signal);
  const response = await postJSON("/v1/chat/completions", { ...body, monolith: { ...monolith, spec: true } }, signal);
  if (response.status !== 400) {
    if (response.ok) specSupported = true;
    return response;
  }
  const error = await errorOf(response);
  if (!(error.param.startsWith("monolith") || /\bmonolith\b/.test(error.message))) {
    throw new HttpError(400, error.message);
  }
  specSupported = false;
  return postJSON("/v1/chat/completions", plain, signal);
}

// POST a streamed chat request; `onChunk(chunk)` for each chunk. Rejects with an
// AbortError when `signal` aborts (the server then cancels the request).
export async function streamChat(body, { signal, onChunk }) {
  const response = await postChat(body, signal);
  if (!response.ok) throw new HttpError(response.status, (await errorOf(response)).message);
  await readEvents(response.body, (data) => {
    if (data !== "[DONE]") onChunk(JSON.parse(data));
  });
}

// Server-Sent Events: each event's data lines joined; comment lines (keep-alives) skipped
async function readEvents(stream, onData) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) onData(data.join("\n"));
    }
  }
}

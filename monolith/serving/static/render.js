// Drawing a message: Markdown (marked) sanitised by DOMPurify, code highlighted by
// highlight.js, reasoning in a collapsible block, tool calls as blocks, and each token
// tinted by how speculation made it (the `monolith.spec` pieces: accepted, correction,
// bonus, plain).

/* global marked, DOMPurify, hljs */

hljs.configure({ ignoreUnescapedHTML: true });
const LOOKAHEAD = 64; // how far tinting looks in the source for a rendered character

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

// Markdown -> sanitised HTML: model output never injects script or event handlers
export function markdownHTML(text) {
  return DOMPurify.sanitize(marked.parse(text, { gfm: true, breaks: false }));
}

// For each UTF-16 unit of `part`'s text ("content" or "reasoning"): the `how` of its piece
function hows(pieces, part) {
  const out = [];
  for (const piece of pieces || []) {
    if (piece.part !== part) continue;
    for (let i = 0; i < piece.text.length; i++) out.push(piece.how);
  }
  return out;
}

// The characters of `node` (a text node) as runs [{text, how}], matched in order
// against `source` (the Markdown) from `at.index`; a character the Markdown does not
// show near by (an entity, say) gets no tint.
function runsOf(node, source, howAt, at) {
  const runs = [];
  for (const ch of node.data) {
    const found = source.indexOf(ch, at.index);
    let how = null;
    if (found >= 0 && found - at.index <= LOOKAHEAD) {
      how = howAt[found] || null;
      at.index = found + ch.length;
    }
    const last = runs[runs.length - 1];
    if (last && last.how === how) last.text += ch;
    else runs.push({ text: ch, how });
  }
  return runs;
}

// Wraps the rendered text of `root` in tinted spans
function tint(root, source, howAt) {
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const nodes = [];
  while (walker.nextNode()) nodes.push(walker.currentNode);
  const at = { index: 0 };
  for (const node of nodes) {
    const runs = runsOf(node, source, howAt, at);
    if (runs.length === 1 && runs[0].how === null) continue;
    const fragment = document.createDocumentFragment();
    for (const run of runs) {
      fragment.append(run.how ? element("span", `tok-${run.how}`, run.text) : document.createTextNode(run.text));
    }
    node.replaceWith(fragment);
  }
}

export function fillMarkdown(el, text, pieces, tinted) {
  el.innerHTML = markdownHTML(text);
  el.querySelectorAll("pre code").forEach((code) => hljs.highlightElement(code));
  const howAt = tinted ? hows(pieces, "content") : [];
  if (howAt.length) tint(el, text, howAt);
}

function fillReasoning(el, text, pieces, tinted) {
  const howAt = tinted ? hows(pieces, "reasoning") : [];
  el.replaceChildren();
  if (!howAt.length) {
    el.textContent = text;
    return;
  }
  for (const piece of pieces) {
    if (piece.part === "reasoning") el.append(element("span", `tok-${piece.how}`, piece.text));
  }
}

function toolCallBlock(call) {
  const block = element("div", "tool-call");
  block.append(element("div", "tool-name", `tool call: ${call.name || "?"}`));
  let args = call.arguments || "";
  try {
    args = JSON.stringify(JSON.parse(args), null, 2);
  } catch { /* shown as it came */ }
  block.append(element("pre", "", args));
  return block;
}

// The reasoning block: open while the model is still reasoning, closed once the answer
// starts, unless the user opened or closed it (kept across redraws)
const chosenOpen = new WeakMap();

function reasoningBlock(message, streaming, tinted) {
  const details = element("details", "reasoning");
  const thinking = streaming && !message.content && !message.toolCalls?.length;
  details.open = chosenOpen.get(message) ?? thinking;
  const summary = element("summary", "", thinking ? "Reasoning..." : "Reasoning");
  summary.addEventListener("click", () => chosenOpen.set(message, !details.open));
  details.append(summary);
  const text = element("div", "reasoning-text");
  fillReasoning(text, message.reasoning, message.spec, tinted);
  details.append(text);
  return details;
}

function userBody(message) {
  const body = element("div", "content");
  body.append(element("div", "user-text", message.content));
  for (const url of message.images || []) {
    const img = element("img", "thumb");
    img.src = url;
    img.alt = "attached image";
    body.append(img);
  }
  return body;
}

function assistantBody(message, streaming, tinted) {
  const parts = [];
  if (message.reasoning) parts.push(reasoningBlock(message, streaming, tinted));
  const content = element("div", "content markdown");
  fillMarkdown(content, message.content, message.spec, tinted);
  parts.push(content);
  for (const call of message.toolCalls || []) parts.push(toolCallBlock(call));
  if (message.error) parts.push(element("div", "error", message.error));
  return parts;
}

function metaLine(message) {
  const bits = [];
  if (message.finish) bits.push(message.finish === "stopped" ? "stopped" : `finish: ${message.finish}`);
  const usage = message.stats?.usage;
  if (usage) bits.push(`${usage.completion_tokens} tokens`);
  return bits.join(" · ");
}

// The element of message `index` of a conversation
export function messageElement(message, index, { streaming, tinted }) {
  const el = element("div", `message ${message.role}`);
  el.dataset.index = index;
  el.append(element("div", "role", message.role));
  if (message.role === "user") el.append(userBody(message));
  else el.append(...assistantBody(message, streaming, tinted));
  const meta = metaLine(message);
  if (meta) el.append(element("div", "meta", meta));
  return el;
}

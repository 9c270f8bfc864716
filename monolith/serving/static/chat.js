// The conversation on screen: sending (streamed), stop, edit-and-resend, regenerate.
// Each request carries the whole history up to the turn (the server's prompt cache
// resumes what it saw before; a resent or edited turn is the same request as a cold one).

import { streamChat } from "./api.js";
import { messageElement } from "./render.js";
import { showStrip } from "./strip.js";
import { saveConversations } from "./store.js";

function number(text, parse) {
  return text === "" || text === undefined || text === null ? undefined : parse(text);
}

function userContent(message) {
  if (!message.images?.length) return message.content;
  const images = message.images.map((url) => ({ type: "image_url", image_url: { url } }));
  return [{ type: "text", text: message.content }, ...images];
}

// The chat/completions body for `messages` under `settings` (store.js)
export function requestBody(messages, settings) {
  const history = settings.system ? [{ role: "system", content: settings.system }] : [];
  for (const m of messages) {
    if (m.role === "user") history.push({ role: "user", content: userContent(m) });
    else if (m.content || !m.error) history.push({ role: "assistant", content: m.content });
  }
  const body = { messages: history, stream: true, stream_options: { include_usage: true } };
  const fields = { temperature: number(settings.temperature, parseFloat), top_p: number(settings.topP, parseFloat),
                   max_tokens: number(settings.maxTokens, (t) => parseInt(t, 10)) };
  for (const [k, v] of Object.entries(fields)) if (v !== undefined && !Number.isNaN(v)) body[k] = v;
  if (!settings.thinking) body.chat_template_kwargs = { enable_thinking: false };
  if (settings.model) body.model = settings.model;
  if (settings.draft === true || (settings.draft === null && settings.draftByDefault)) body.monolith = { draft: true };
  return body;
}

// One streamed chunk into the assistant message
export function applyChunk(message, chunk) {
  if (chunk.usage) message.stats.usage = chunk.usage;
  if (chunk.monolith?.stats) message.stats.spec = chunk.monolith.stats;
  const choice = chunk.choices?.[0];
  if (!choice) return;
  const delta = choice.delta || {};
  if (delta.content) message.content += delta.content;
  if (delta.reasoning_content) message.reasoning += delta.reasoning_content;
  for (const call of delta.tool_calls || []) {
    const at = call.index ?? message.toolCalls.length;
    const slot = (message.toolCalls[at] ||= { name: "", arguments: "" });
    slot.name += call.function?.name || "";
    slot.arguments += call.function?.arguments || "";
  }
  if (delta.monolith?.spec) message.spec.push(...delta.monolith.spec);
  if (delta.content || delta.reasoning_content) {
    message.timing.first ||= Date.now();
    message.timing.last = Date.now();
    message.chunks += 1;
  }
  if (choice.finish_reason) message.finish = choice.finish_reason;
}

function assistantMessage() {
  return { role: "assistant", content: "", reasoning: "", toolCalls: [], spec: [], stats: {}, timing: {},
           chunks: 0, finish: null, error: null };
}

function button(label, className, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = className;
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

export class Chat {
  constructor(state, settings, elements) {
    this.state = state; // store.js loadConversations()
    this.settings = settings;
    this.el = elements; // {messages, send, stop, onChange}
    this.controller = null;
    this.pending = false;
  }

  get conversation() {
    return this.state.conversations.find((c) => c.id === this.state.current) || this.state.conversations[0];
  }

  get busy() {
    return this.controller !== null;
  }

  save() {
    saveConversations(this.state);
  }

  render() {
    const messages = this.conversation.messages;
    this.el.messages.replaceChildren(...messages.map((m, i) => this.messageView(m, i)));
    showStrip(messages[messages.length - 1]);
    this.el.send.disabled = this.busy;
    this.el.stop.hidden = !this.busy;
    this.el.messages.scrollTop = this.el.messages.scrollHeight;
  }

  messageView(message, index) {
    const streaming = this.busy && index === this.conversation.messages.length - 1;
    const el = messageElement(message, index, { streaming, tinted: this.settings.tint });
    if (!this.busy) el.append(this.actions(message, index));
    return el;
  }

  actions(message, index) {
    const row = document.createElement("div");
    row.className = "actions";
    row.append(button("Edit", "edit", () => this.startEdit(index)));
    const label = message.role === "user" ? "Resend" : "Regenerate";
    row.append(button(label, "regenerate", () => this.regenerate(index)));
    return row;
  }

  // redraw the streaming message at most once a frame
  redrawLast() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      const messages = this.conversation.messages;
      const last = messages.length - 1;
      const old = this.el.messages.lastElementChild;
      if (old) old.replaceWith(this.messageView(messages[last], last));
      showStrip(messages[last]);
      this.el.messages.scrollTop = this.el.messages.scrollHeight;
    });
  }

  send(text, images) {
    const conversation = this.conversation;
    if (conversation.title === "New chat" && text) conversation.title = text.slice(0, 40);
    conversation.messages.push({ role: "user", content: text, images });
    this.el.onChange();
    return this.reply();
  }

  // Streams the assistant's answer to the conversation as it stands
  async reply() {
    const messages = this.conversation.messages;
    const body = requestBody(messages, this.settings);
    const message = assistantMessage();
    messages.push(message);
    this.controller = new AbortController();
    message.timing.sent = Date.now();
    this.render();
    try {
      await streamChat(body, { signal: this.controller.signal,
                               onChunk: (chunk) => { applyChunk(message, chunk); this.redrawLast(); } });
    } catch (e) {
      if (e.name === "AbortError") message.finish = "stopped";
      else message.error = e.message || String(e);
    } finally {
      this.controller = null;
      this.save();
      this.render();
    }
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  // Drops the history from message `index` on and asks again (a user message is kept and resent)
  regenerate(index) {
    if (this.busy) return;
    const messages = this.conversation.messages;
    messages.splice(messages[index].role === "user" ? index + 1 : index);
    this.save();
    return this.reply();
  }

  startEdit(index) {
    if (this.busy) return;
    const message = this.conversation.messages[index];
    const view = this.el.messages.children[index];
    const box = document.createElement("textarea");
    box.className = "editing";
    box.value = message.content;
    box.rows = Math.min(12, message.content.split("\n").length + 1);
    const row = document.createElement("div");
    row.className = "actions";
    const label = message.role === "user" ? "Save and send" : "Save";
    row.append(button(label, "save-edit", () => this.finishEdit(index, box.value)),
               button("Cancel", "cancel-edit", () => this.render()));
    view.replaceChildren(view.querySelector(".role"), box, row);
    box.focus();
  }

  // The edited message replaces the old one and the history after it is dropped; an
  // edited user message is sent again
  finishEdit(index, text) {
    const messages = this.conversation.messages;
    const message = messages[index];
    messages.splice(index + 1);
    if (message.role === "user") {
      message.content = text;
      this.save();
      return this.reply();
    }
    Object.assign(message, { content: text, spec: [], finish: "edited", error: null });
    this.save();
    this.render();
  }
}

// Conversations and settings, kept in the browser's localStorage. A conversation:
// {id, title, created, messages}; a message: {role: "user" | "assistant", content,
// images (data: URLs, user), reasoning, toolCalls [{name, arguments}], spec (the
// speculation pieces), stats, finish, error (assistant)}.

const CONVERSATIONS = "monolith.conversations";
const SETTINGS = "monolith.settings";
// draft: null follows the server (on where it decodes plainly and drafts on request), else the user's choice
export const DEFAULT_SETTINGS = { system: "", temperature: "", topP: "", maxTokens: "", thinking: true, tint: true,
                                  model: "", draft: null };

function read(item, fallback) {
  try {
    return JSON.parse(localStorage.getItem(item)) ?? fallback;
  } catch {
    return fallback;
  }
}

function write(item, value) {
  try {
    localStorage.setItem(item, JSON.stringify(value));
  } catch (e) {
    console.warn(`could not save ${item} (the browser's storage is full?)`, e);
  }
}

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
}

export function saveSettings(settings) {
  const { draftByDefault, ...chosen } = settings; // the server's default is learnt afresh at each load
  write(SETTINGS, chosen);
}

export function newId() {
  return `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
}

export function newConversation() {
  return { id: newId(), title: "New chat", created: Date.now(), messages: [] };
}

// {conversations: [...], current: id}
export function loadConversations() {
  const state = read(CONVERSATIONS, null);
  if (state && Array.isArray(state.conversations) && state.conversations.length) return state;
  const first = newConversation();
  return { conversations: [first], current: first.id };
}

export function saveConversations(state) {
  write(CONVERSATIONS, state);
}

export function exportJSON(state) {
  return JSON.stringify({ format: "monolith-chat", version: 1, conversations: state.conversations }, null, 2);
}

function checkConversation(c, i) {
  const where = `conversations[${i}]`;
  if (!c || typeof c !== "object" || !Array.isArray(c.messages)) throw new Error(`${where} has no messages list`);
  c.messages.forEach((m, j) => {
    if (!m || !["user", "assistant"].includes(m.role) || typeof m.content !== "string") {
      throw new Error(`${where}.messages[${j}] needs a role (user or assistant) and a string content`);
    }
  });
}

// Adds the conversations of an export (exportJSON) to `state`; those whose id is taken get a new one.
export function importJSON(text, state) {
  const data = JSON.parse(text);
  const list = Array.isArray(data) ? data : data.conversations;
  if (!Array.isArray(list)) throw new Error("no conversations list in this file");
  list.forEach(checkConversation);
  const taken = new Set(state.conversations.map((c) => c.id));
  for (const c of list) {
    const id = typeof c.id === "string" && !taken.has(c.id) ? c.id : newId();
    taken.add(id);
    state.conversations.push({ ...c, id, title: String(c.title || "Imported chat") });
  }
  return list.length;
}

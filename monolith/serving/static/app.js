// The chat page (docs/serving.md, "The chat page"): wiring of the sidebar (the
// conversations), the tabs, the settings, the message box (images pasted, dropped or
// attached) and the API key dialog.

import { forgetKey, getJSON, onKeyNeeded } from "./api.js";
import { Chat } from "./chat.js";
import { startStatus } from "./status.js";
import {
  exportJSON, importJSON, loadConversations, loadSettings, newConversation, saveConversations, saveSettings,
} from "./store.js";

const $ = (id) => document.getElementById(id);
const state = loadConversations();
const settings = loadSettings();
let images = []; // data: URLs waiting in the message box
const chat = new Chat(state, settings, {
  messages: $("messages"), send: $("send"), stop: $("stop"), onChange: () => drawSidebar(),
});

// ------------------------------------------------------------ the API key

let keyAsked = null; // one dialog for all requests that got a 401 meanwhile

function askKey() {
  keyAsked ||= new Promise((resolve) => {
    const dialog = $("key-dialog");
    const done = (key) => {
      keyAsked = null;
      dialog.close();
      resolve(key);
    };
    $("key-form").onsubmit = (e) => {
      e.preventDefault();
      done($("key-input").value.trim() || null);
    };
    dialog.oncancel = () => done(null);
    dialog.showModal();
  });
  return keyAsked;
}

// ------------------------------------------------------------ conversations

function conversationItem(c) {
  const li = document.createElement("li");
  li.className = c.id === state.current ? "current" : "";
  li.dataset.id = c.id;
  const title = document.createElement("span");
  title.className = "title";
  title.textContent = c.title;
  li.append(title, smallButton("✎", "rename", () => rename(c)), smallButton("×", "delete", () => remove(c)));
  li.addEventListener("click", () => select(c.id));
  return li;
}

function smallButton(text, className, action) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = className;
  b.textContent = text;
  b.title = className;
  b.addEventListener("click", (e) => { e.stopPropagation(); action(); });
  return b;
}

function drawSidebar() {
  $("conversations").replaceChildren(...state.conversations.map(conversationItem));
  saveConversations(state);
}

function select(id) {
  if (chat.busy) return;
  state.current = id;
  drawSidebar();
  chat.render();
}

function rename(c) {
  const title = prompt("Rename the conversation", c.title);
  if (title) c.title = title;
  drawSidebar();
}

function remove(c) {
  if (chat.busy || !confirm(`Delete "${c.title}"?`)) return;
  state.conversations = state.conversations.filter((x) => x !== c);
  if (!state.conversations.length) state.conversations.push(newConversation());
  if (!state.conversations.some((x) => x.id === state.current)) state.current = state.conversations[0].id;
  select(state.current);
}

function startNew() {
  const c = newConversation();
  state.conversations.unshift(c);
  select(c.id);
}

function exportAll() {
  const blob = new Blob([exportJSON(state)], { type: "application/json" });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = "monolith-conversations.json";
  link.click();
  URL.revokeObjectURL(link.href);
}

async function importFile(file) {
  try {
    const count = importJSON(await file.text(), state);
    drawSidebar();
    alert(`Imported ${count} conversation${count === 1 ? "" : "s"}.`);
  } catch (e) {
    alert(`Could not import ${file.name}: ${e.message}`);
  }
}

// ------------------------------------------------------------ tabs and settings

let statusStarted = false;

function showTab(name) {
  for (const b of document.querySelectorAll("#tabs button[data-tab]")) b.classList.toggle("active", b.dataset.tab === name);
  for (const view of ["chat", "status", "settings"]) $(`${view}-view`).hidden = view !== name;
  if (name === "status" && !statusStarted) {
    statusStarted = true;
    startStatus($("charts"));
  }
}

const SETTING_INPUTS = { system: "set-system", temperature: "set-temperature", topP: "set-top-p",
                         maxTokens: "set-max-tokens", thinking: "set-thinking", tint: "set-tint" };

function bindSettings() {
  for (const [name, id] of Object.entries(SETTING_INPUTS)) {
    const input = $(id);
    const checkbox = input.type === "checkbox";
    if (checkbox) input.checked = settings[name];
    else input.value = settings[name];
    input.addEventListener("change", () => {
      settings[name] = checkbox ? input.checked : input.value;
      saveSettings(settings);
      if (name === "tint") chat.render();
    });
  }
}

// ------------------------------------------------------------ the message box

function drawAttachments() {
  $("attachments").replaceChildren(...images.map((url, i) => {
    const box = document.createElement("span");
    box.className = "attachment";
    const img = document.createElement("img");
    img.src = url;
    img.alt = "image to send";
    box.append(img, smallButton("×", "remove-image", () => { images.splice(i, 1); drawAttachments(); }));
    return box;
  }));
}

function addImages(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => { images.push(reader.result); drawAttachments(); };
    reader.readAsDataURL(file);
  }
}

function submit(event) {
  event.preventDefault();
  const text = $("input").value.trim();
  if (chat.busy || (!text && !images.length)) return;
  const sent = images;
  images = [];
  $("input").value = "";
  drawAttachments();
  chat.send(text, sent);
}

function bindComposer() {
  const composer = $("composer");
  composer.addEventListener("submit", submit);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) submit(e);
  });
  $("input").addEventListener("paste", (e) => {
    const files = [...(e.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
    if (files.length) {
      e.preventDefault();
      addImages(files);
    }
  });
  composer.addEventListener("dragover", (e) => { e.preventDefault(); composer.classList.add("dropping"); });
  composer.addEventListener("dragleave", () => composer.classList.remove("dropping"));
  composer.addEventListener("drop", (e) => {
    e.preventDefault();
    composer.classList.remove("dropping");
    addImages(e.dataTransfer?.files || []);
  });
  $("attach").addEventListener("change", (e) => { addImages(e.target.files); e.target.value = ""; });
  $("stop").addEventListener("click", () => chat.stop());
}

// ------------------------------------------------------------ start

// The model picker: the server's configured models, each with whether it is loaded
// (GET /v1/models); the pick is kept in the settings and sent as the request's `model`.
async function showModels() {
  const pick = $("model-pick");
  try {
    const models = (await getJSON("/v1/models")).data;
    if (!models.some((m) => m.id === settings.model)) settings.model = models[0]?.id || "";
    pick.replaceChildren(...models.map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = m.loaded === false ? `${m.id} (not loaded)` : m.id;
      option.selected = m.id === settings.model;
      return option;
    }));
    showDecoding((models.find((m) => m.id === settings.model) || models[0])?.monolith);
  } catch (e) {
    pick.replaceChildren(new Option(`(${e.message})`, ""));
  }
}

$("model-pick").addEventListener("change", (e) => {
  settings.model = e.target.value;
  saveSettings(settings);
  showModels(); // the picked model's decoding
});
$("model-pick").addEventListener("focus", showModels); // the loaded states as they are now

// How the server decodes (/v1/models' `monolith`): where it decodes plainly but holds a
// drafter, replies are drafted by default (monolith.draft) so that the tint shows speculation
function showDecoding(mode) {
  const box = $("set-draft"), note = $("draft-note");
  settings.draftByDefault = Boolean(mode && mode.decoding === "plain" && mode.draft_on_request);
  box.disabled = !mode?.draft_on_request;
  box.checked = !box.disabled && (settings.draft ?? settings.draftByDefault);
  note.hidden = false;
  if (!mode) note.textContent = "This server does not say how it decodes.";
  else if (!mode.draft_on_request) note.textContent = "This server holds no drafter: every reply is decoded plainly.";
  else if (mode.decoding === "plain") {
    note.textContent = `This server decodes plainly: drafting does not pay on its hardware (a CPU), so a drafted reply `
      + `is slower. Drafting with ${mode.draft} is on here to show how speculation makes each token.`;
  } else note.textContent = `This server drafts with ${mode.draft} where it pays; this drafts every round.`;
}

function bindDraft() {
  $("set-draft").addEventListener("change", (e) => {
    settings.draft = e.target.checked;
    saveSettings(settings);
  });
}

onKeyNeeded(askKey);
$("new-chat").addEventListener("click", startNew);
$("export").addEventListener("click", exportAll);
$("import").addEventListener("change", (e) => { if (e.target.files[0]) importFile(e.target.files[0]); e.target.value = ""; });
$("forget-key").addEventListener("click", forgetKey);
for (const b of document.querySelectorAll("#tabs button[data-tab]")) b.addEventListener("click", () => showTab(b.dataset.tab));
bindSettings();
bindDraft();
bindComposer();
$("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("sidebar-open"));
drawSidebar();
chat.render();
showModels();
document.body.dataset.ready = "true";

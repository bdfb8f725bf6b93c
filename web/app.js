// Duplex web demo: wires the conversation, the WebSocket, the settings and the server panel.
//
// One request at a time: Send becomes Stop while an answer streams. The conversation sent with
// each request holds the finished turns of the current saved conversation (conversations.js):
// a stopped answer keeps what it said; a failed one is left out, so the next question does not
// carry it. Edit (a user message) and Regenerate (an answer) cut the conversation at that
// message and ask again from there.

import { KeyDialog, checkAccess, socketProtocols, storeKey } from "./auth.js";
import { ChatView } from "./chat.js";
import { Connection } from "./connection.js";
import { ConversationStore } from "./conversations.js";
import { HistoryDialog } from "./history.js";
import { Settings } from "./settings.js";
import { StatusPanel } from "./status.js";
import { formatCount } from "./dom.js";

const CONNECTION_TEXT = { open: "Connected", connecting: "Connecting…", waiting: "Offline",
                          locked: "API key needed" };
const $ = (id) => document.getElementById(id);
const ui = {
  prompt: $("prompt"), send: $("send"), stop: $("stop"), composer: $("composer"),
  banner: $("banner"), bannerText: $("banner-text"), countdown: $("banner-countdown"),
  retry: $("retry-now"),
  conn: $("conn"), connText: $("conn-text"), model: $("model-name"), context: $("model-context"),
  announcer: $("announcer"), panel: $("server-panel"), panelToggle: $("toggle-panel"),
};

const connection = new Connection(socketUrl(), socketProtocols);
const store = new ConversationStore();
const chat = new ChatView($("conversation"), $("empty-state"), onMessageAction);
const settings = new Settings($("settings"));
const panel = new StatusPanel(ui.panel);
const historyDialog = new HistoryDialog($("history"), store, { open: openConversation,
                                                               startNew: newChat });
let current = null;  // the request in flight: {id, answer, question}
let numSent = 0;
let engineStatus = "ok";
let bannerTimer = 0;

// ================================================================ conversation
function send(text) {
  const question = text.trim();
  if (!question || current || !connection.isOpen) return;
  ask(question);
  ui.prompt.value = "";
  resizePrompt();
}

/** Sends `question` after the current conversation's finished turns. */
function ask(question) {
  const turns = store.current.messages.map(({ role, content }) => ({ role, content }));
  const messages = [settings.systemMessage(), ...turns, { role: "user", content: question }]
    .filter(Boolean);
  const id = `web-${Date.now().toString(36)}-${++numSent}`;
  chat.addUser(question, turns.length);
  const answer = chat.addAnswer(turns.length + 1);
  const request = current = { id, answer, question };
  const frame = { type: "chat", id, messages, ...settings.requestFields() };
  const handler = {
    delta: (delta) => answer.onDelta(delta),
    done: (done) => {
      answer.onDone(done);
      finish(request, done);
    },
    error: (error) => {
      answer.onError(error);
      finish(request, error);
    },
  };
  if (!connection.start(frame, handler)) {
    handler.error({ type: "error", id, code: "connection_lost", message: "not connected" });
  }
  updateComposer();
}

/** The terminal frame of `request`; ignored for a request a new chat left behind. */
function finish(request, frame) {
  if (request !== current) return;
  current = null;
  const { answer, question } = request;
  if (frame.type === "done" || (frame.code === "cancelled" && answer.text)) {
    store.addTurn(question, answer.text, frame.type === "done" ? frame
      : { stopped: true, num_tokens: answer.numTokens });
  }
  announce(frame.type === "done"
    ? `Answer finished: ${formatCount(frame.usage.completion_tokens)} tokens.`
    : frame.code === "cancelled" ? "Answer stopped." : `Error: ${frame.message || frame.code}`);
  updateComposer();
  panel.refresh();
  const focus = document.activeElement;
  if (focus === document.body || focus === ui.stop) ui.prompt.focus();
}

function stop() {
  if (current) connection.cancel(current.id);
}

/** Edit: ask the edited question in place of message `index`; regenerate: ask the question
 * before answer `index` again. Either way what followed is dropped. */
function onMessageAction(action, index, text) {
  if (current || !connection.isOpen) return;
  const userIndex = action === "edit" ? index : index - 1;
  const question = action === "edit" ? text : store.current.messages[userIndex]?.content;
  if (question === undefined) return;
  store.truncate(userIndex);
  showConversation();
  ask(question);
}

/** Draws the current conversation's saved turns. */
function showConversation() {
  chat.clear();
  store.current.messages.forEach((message, index) => {
    if (message.role === "user") chat.addUser(message.content, index);
    else chat.addAnswer(index).restore(message.content, message.final);
  });
}

function openConversation(id) {
  stop();
  current = null;
  store.open(id);
  showConversation();
  updateComposer();
}

function newChat() {
  stop();
  current = null;
  store.startNew();
  chat.clear();
  updateComposer();
  ui.prompt.focus();
}

// ================================================================ composer
function updateComposer() {
  const busy = current !== null;
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  ui.send.disabled = !connection.isOpen || !ui.prompt.value.trim();
  ui.send.title = connection.isOpen ? "Send (Enter)" : "Not connected to the server";
  ui.composer.dataset.busy = String(busy);
}

function resizePrompt() {
  ui.prompt.style.height = "auto";
  ui.prompt.style.height = `${Math.min(ui.prompt.scrollHeight, 220)}px`;
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send(ui.prompt.value);
});
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send(ui.prompt.value);
  }
});
ui.prompt.addEventListener("input", () => {
  resizePrompt();
  updateComposer();
});
ui.stop.addEventListener("click", stop);
document.addEventListener("keydown", (event) => {
  if (event.key !== "Escape" || document.querySelector("dialog[open]")) return;
  if (document.body.classList.contains("panel-open")) togglePanel(false);
  else stop();
});
$("new-chat").addEventListener("click", newChat);
$("open-history").addEventListener("click", () => historyDialog.open());
$("open-settings").addEventListener("click", () => settings.open());
for (const button of document.querySelectorAll("[data-prompt]")) {
  button.addEventListener("click", () => send(button.dataset.prompt));
}

// ================================================================ server panel (narrow screens)
function togglePanel(open = !document.body.classList.contains("panel-open")) {
  document.body.classList.toggle("panel-open", open);
  ui.panelToggle.setAttribute("aria-expanded", String(open));
  if (open) ui.panel.focus();
}

ui.panelToggle.addEventListener("click", () => togglePanel());
$("close-panel").addEventListener("click", () => togglePanel(false));
document.querySelector(".backdrop").addEventListener("click", () => togglePanel(false));

// ================================================================ connection and banner
connection.addEventListener("state", () => {
  const { state } = connection;
  ui.conn.dataset.state = state;
  ui.connText.textContent = CONNECTION_TEXT[state];
  updateComposer();
  updateBanner();
});
connection.addEventListener("orphan", (event) => {
  chat.addNotice(`Server error (${event.detail.code}): ${event.detail.message}`, "error");
});
ui.retry.addEventListener("click", () => connection.retryNow());

panel.addEventListener("status", (event) => {
  const snapshot = event.detail;
  engineStatus = snapshot.status;
  if (snapshot.model) {
    ui.model.textContent = snapshot.model;
    document.title = `Duplex · ${snapshot.model}`;
  }
  if (snapshot.maxModelLen) ui.context.textContent = `${formatCount(snapshot.maxModelLen)} ctx`;
  settings.applyServer(snapshot);
  updateBanner();
});
panel.addEventListener("offline", () => {
  engineStatus = "unreachable";
  updateBanner();
});

/** Server gone (socket closed): count down to the next try. Server up, engine not ready: say so.
 * The countdown is hidden from screen readers, so the alert is announced once, not per second. */
function updateBanner() {
  clearTimeout(bannerTimer);
  const state = connection.state;
  let text = "";
  let kind = "warn";
  let countdown = "";
  if (state === "waiting") {
    const seconds = Math.max(0, Math.ceil((connection.retryAt - Date.now()) / 1000));
    text = "Can't reach the server — it may be restarting.";
    countdown = ` Reconnecting in ${seconds} s…`;
    kind = "error";
    bannerTimer = setTimeout(updateBanner, 250);
  } else if (state === "connecting" && connection.attempt > 0) {
    text = "Can't reach the server — reconnecting…";
    kind = "error";
  } else if (state === "open" && engineStatus === "unavailable") {
    text = "The server is up but no engine worker is ready yet (starting or restarting). "
      + "Answers resume when it is.";
  } else if (state === "open" && engineStatus === "draining") {
    text = "The server is shutting down: it finishes running answers and takes no new ones.";
  }
  ui.banner.hidden = !text;
  ui.banner.dataset.kind = kind;
  ui.retry.hidden = state !== "waiting";
  if (ui.bannerText.textContent !== text) ui.bannerText.textContent = text;
  ui.countdown.textContent = countdown;
}

function announce(text) {
  ui.announcer.textContent = text;
}

function socketUrl() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  return `${scheme}://${location.host}/v1/ws`;
}

// ================================================================ API key
const keyDialog = new KeyDialog($("key-dialog"), (key) => {
  storeKey(key);
  start();
});

/** Connects once the server lets this page in; asks for a key when it says one is needed. */
async function start() {
  const access = await checkAccess();
  if (access === "needed" || access === "wrong") {
    connection.lock();
    keyDialog.ask(access);
    return;
  }
  if (connection.isOpen) connection.socket.close();  // a new key: reconnect with it
  else connection.connect();
  panel.refresh();
}

// A socket refused at the handshake: a key that stopped working, or a server that is down.
connection.addEventListener("refused", async () => {
  const access = await checkAccess();
  if (access === "needed" || access === "wrong") {
    connection.lock();
    keyDialog.ask(access);
  }
});
$("change-key").addEventListener("click", () => {
  settings.dialog.close();
  keyDialog.ask("change");
});

showConversation();
start();
panel.start();
updateComposer();
ui.prompt.focus();

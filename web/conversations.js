// Saved conversations: the one owner of what localStorage holds about chats.
//
// A conversation is {id, title, createdAt, updatedAt, messages}; messages are the finished
// turns, [{role: "user" | "assistant", content, final?}] (`final`: the answer's terminal frame,
// so its statistics come back after a reload; {stopped, num_tokens} for a stopped answer). A conversation is stored once it has a turn.
// `current` is the one on screen; its id survives a reload.

const STORAGE_KEY = "duplex.conversations.v1";
const CURRENT_KEY = "duplex.currentConversation.v1";
const TITLE_CHARS = 48;

export class ConversationStore extends EventTarget {
  constructor() {
    super();
    this.all = loadAll();
    const currentId = read(CURRENT_KEY);
    this.current = this.all.find((c) => c.id === currentId) || newConversation();
  }

  /** Most recently changed first. */
  list() {
    return [...this.all].sort((a, b) => b.updatedAt - a.updatedAt);
  }

  startNew() {
    this.current = newConversation();
    this.save();
  }

  open(id) {
    const found = this.all.find((c) => c.id === id);
    if (found) this.current = found;
    this.save();
    return found;
  }

  /** Appends a finished turn (question and answer) to the current conversation. */
  addTurn(question, answer, final) {
    const conv = this.current;
    conv.messages.push({ role: "user", content: question },
                       { role: "assistant", content: answer, ...(final ? { final } : {}) });
    if (!conv.title) conv.title = titleOf(question);
    this.touch(conv);
  }

  /** Drops messages[index:] of the current conversation (edit / regenerate from there). */
  truncate(index) {
    this.current.messages.length = Math.min(index, this.current.messages.length);
    this.touch(this.current);
  }

  rename(id, title) {
    const conv = this.all.find((c) => c.id === id);
    if (!conv || !title.trim()) return;
    conv.title = title.trim();
    this.save();  // a rename does not move it up the list
  }

  remove(id) {
    this.all = this.all.filter((c) => c.id !== id);
    if (this.current.id === id) this.current = newConversation();
    this.save();
  }

  /** A JSON document of conversations (all when `id` is null), for a download. */
  exportJson(id = null) {
    const chosen = id === null ? this.list() : this.all.filter((c) => c.id === id);
    return JSON.stringify({ format: "duplex.conversations", version: 1,
                            conversations: chosen }, null, 2);
  }

  touch(conv) {
    conv.updatedAt = Date.now();
    if (conv.messages.length && !this.all.includes(conv)) this.all.push(conv);
    this.save();
  }

  save() {
    write(STORAGE_KEY, JSON.stringify(this.all));
    write(CURRENT_KEY, this.current.id);
    this.dispatchEvent(new CustomEvent("change"));
  }
}

function newConversation() {
  const now = Date.now();
  return { id: `c-${now.toString(36)}-${Math.random().toString(36).slice(2, 8)}`, title: "",
           createdAt: now, updatedAt: now, messages: [] };
}

function titleOf(text) {
  const line = text.trim().split("\n")[0];
  return line.length > TITLE_CHARS ? `${line.slice(0, TITLE_CHARS - 1)}…` : line;
}

function loadAll() {
  try {
    const all = JSON.parse(read(STORAGE_KEY) || "[]");
    return Array.isArray(all) ? all.filter(isConversation) : [];
  } catch {
    return [];
  }
}

function isConversation(c) {
  return c && typeof c.id === "string" && Array.isArray(c.messages)
    && c.messages.every((m) => (m.role === "user" || m.role === "assistant")
                               && typeof m.content === "string");
}

function read(key) {
  try {
    return localStorage.getItem(key);
  } catch {
    return null;
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, value);
  } catch {
    // storage full or disabled: conversations then last for this page only
  }
}

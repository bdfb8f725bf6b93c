// The conversations dialog: the saved chats (newest first), each to open, rename (in place),
// delete or export; "Export all" downloads every one as one JSON file. State: conversations.js.

import { el } from "./dom.js";

export class HistoryDialog {
  /** `actions`: {open(id), startNew()}, run by the app (it owns the chat on screen). */
  constructor(dialog, store, actions) {
    this.dialog = dialog;
    this.store = store;
    this.actions = actions;
    this.list = dialog.querySelector("[data-field=conversations]");
    store.addEventListener("change", () => { if (dialog.open) this.render(); });
    dialog.querySelector("[data-action=export-all]").addEventListener("click",
      () => download("duplex-conversations.json", store.exportJson()));
    this.list.addEventListener("click", (event) => this.onClick(event));
  }

  open() {
    this.render();
    this.dialog.showModal();
  }

  render() {
    const rows = this.store.list().map((conv) => el("li", {
      "data-id": conv.id, "aria-current": conv.id === this.store.current.id ? "true" : null,
    },
      el("button", { type: "button", class: "title link", "data-action": "open" },
         conv.title || "Untitled"),
      el("span", { class: "when" }, `${conv.messages.length / 2} turns · `
         + new Date(conv.updatedAt).toLocaleString()),
      el("button", { type: "button", class: "ghost small", "data-action": "rename" }, "Rename"),
      el("button", { type: "button", class: "ghost small", "data-action": "export" }, "Export"),
      el("button", { type: "button", class: "ghost small danger-text", "data-action": "delete" },
         "Delete")));
    this.list.replaceChildren(...rows);
    if (!rows.length) this.list.append(el("li", { class: "muted" }, "No saved conversations yet."));
  }

  onClick(event) {
    const button = event.target.closest("button[data-action]");
    const row = button?.closest("li[data-id]");
    if (!row) return;
    const id = row.dataset.id;
    const action = button.dataset.action;
    if (action === "open") {
      this.dialog.close();
      this.actions.open(id);
    } else if (action === "rename") {
      this.rename(row, id);
    } else if (action === "export") {
      download(`duplex-conversation-${id}.json`, this.store.exportJson(id));
    } else if (action === "delete") {
      const wasCurrent = id === this.store.current.id;
      this.store.remove(id);
      if (wasCurrent) this.actions.startNew();
      this.render();
    }
  }

  rename(row, id) {
    const title = row.querySelector(".title");
    const box = el("input", { type: "text", class: "rename", "aria-label": "New title" });
    box.value = title.textContent;
    title.replaceWith(box);
    box.focus();
    box.select();
    const done = (keep) => {
      if (keep) this.store.rename(id, box.value);
      this.render();
    };
    box.addEventListener("keydown", (event) => {
      if (event.key === "Enter") done(true);
      if (event.key === "Escape") {
        event.preventDefault();
        done(false);
      }
    });
    box.addEventListener("blur", () => done(true), { once: true });
  }
}

function download(name, text) {
  const url = URL.createObjectURL(new Blob([text], { type: "application/json" }));
  const link = el("a", { href: url, download: name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

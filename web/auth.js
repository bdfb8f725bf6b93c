// The API key of the page: asked for when the server says it needs one, kept in localStorage,
// sent as a header on fetches and inside the WebSocket's subprotocol list (a browser cannot set
// headers on a WebSocket), never in a URL. Server side: frontend/auth.py.
//
// `checkAccess()` asks GET /v1/status, which is behind the key when keys are on:
// "ok" (open, or the key is right), "needed" (401 and no key stored), "wrong" (401 with a key),
// "offline" (no answer).

const STORAGE_KEY = "duplex.apiKey.v1";
const WS_PROTOCOL = "duplex.v1";
const WS_KEY_PREFIX = "duplex.key.";

export function storedKey() {
  try {
    return localStorage.getItem(STORAGE_KEY) || "";
  } catch {
    return "";
  }
}

export function storeKey(key) {
  try {
    if (key) localStorage.setItem(STORAGE_KEY, key);
    else localStorage.removeItem(STORAGE_KEY);
  } catch {
    // storage disabled: the key lasts for this page only
  }
  memoryKey = key;
}

let memoryKey = storedKey();

export function authHeaders() {
  return memoryKey ? { Authorization: `Bearer ${memoryKey}` } : {};
}

/** Subprotocols of a new WebSocket: the server selects WS_PROTOCOL, the second carries the key. */
export function socketProtocols() {
  return memoryKey ? [WS_PROTOCOL, WS_KEY_PREFIX + base64url(memoryKey)] : [WS_PROTOCOL];
}

export async function checkAccess() {
  try {
    const response = await fetch("/v1/status", { cache: "no-store", headers: authHeaders() });
    if (response.status === 401) return memoryKey ? "wrong" : "needed";
    return "ok";
  } catch {
    return "offline";
  }
}

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  const binary = Array.from(bytes, (b) => String.fromCharCode(b)).join("");
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

/** The key dialog: says why it opened (needed / wrong) and hands the typed key to `onKey`. */
export class KeyDialog {
  constructor(dialog, onKey) {
    this.dialog = dialog;
    this.form = dialog.querySelector("form");
    this.message = dialog.querySelector("[data-field=key-message]");
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      const key = this.form.elements.key.value.trim();
      if (!key) return;
      this.dialog.close();
      onKey(key);
    });
  }

  ask(reason) {
    this.dialog.dataset.reason = reason;
    this.message.textContent = {
      wrong: "The server refused this API key (wrong key). Check it and try again.",
      needed: "This server needs an API key (it was started with --api-key).",
    }[reason] || "The API key this page sends to the server.";
    this.form.elements.key.value = "";
    if (!this.dialog.open) this.dialog.showModal();
    this.form.elements.key.focus();
  }
}

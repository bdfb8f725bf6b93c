// The page's one WebSocket to /v1/ws (frames: frontend/protocol.py, "WebSocket frames").
//
// Owns the socket, its reconnect schedule and the handlers of requests in flight, keyed by the
// client-chosen id every frame carries. Each request ends with exactly one call of its `done`
// or `error` handler: from the server's terminal frame, or from here when the socket is lost
// (the server aborts a closed socket's requests, so nothing would ever arrive).
//
// Events: "state" with detail {state: "connecting" | "open" | "waiting" | "locked",
// retryAt (ms epoch)}; "refused" when a socket closed before it ever opened (the app then asks
// whether the API key was the reason, and `lock()`s the connection until there is a new key).

const MIN_BACKOFF_MS = 500;
const MAX_BACKOFF_MS = 10_000;
const PING_EVERY_MS = 20_000;
const SILENCE_LIMIT_MS = 45_000;  // no frame for this long after a ping: the socket is dead

export class Connection extends EventTarget {
  constructor(url, protocols = () => []) {
    super();
    this.url = url;
    this.protocols = protocols;  // () -> subprotocols of the next socket (auth.socketProtocols)
    this.socket = null;
    this.state = "connecting";
    this.retryAt = 0;
    this.attempt = 0;  // failed connects since the last open socket
    this.handlers = new Map();  // request id -> {delta, done, error}
    this.retryTimer = 0;
    this.pingTimer = 0;
    this.lastFrameAt = 0;
  }

  get isOpen() {
    return this.state === "open";
  }

  connect() {
    clearTimeout(this.retryTimer);
    this.setState("connecting");
    let socket;
    try {
      socket = new WebSocket(this.url, this.protocols());
    } catch {
      this.scheduleRetry();
      return;
    }
    this.socket = socket;
    socket.addEventListener("open", () => this.onOpen(socket));
    socket.addEventListener("message", (event) => this.onMessage(event));
    socket.addEventListener("close", () => this.onClose(socket));
  }

  /** No more tries until `connect()` (the server refused the API key). */
  lock() {
    clearTimeout(this.retryTimer);
    const socket = this.socket;
    if (socket) {  // one opened with the old key: close it, and end what it carried
      this.socket = null;
      clearInterval(this.pingTimer);
      socket.close();
      for (const id of [...this.handlers.keys()]) this.finish(id, "error", lostFrame(id));
    }
    this.setState("locked");
  }

  /** Skip the wait of the current backoff. */
  retryNow() {
    if (this.state === "waiting") this.connect();
  }

  /** Starts a request; false (and no handler kept) when the socket is not open. */
  start(frame, handler) {
    if (!this.send(frame)) return false;
    this.handlers.set(frame.id, handler);
    return true;
  }

  /** Asks the server to stop request `id`; its handler then gets the "cancelled" error. */
  cancel(id) {
    if (!this.send({ type: "cancel", id })) this.finish(id, "error", lostFrame(id));
  }

  send(frame) {
    if (!this.isOpen) return false;
    this.socket.send(JSON.stringify(frame));
    return true;
  }

  // ------------------------------------------------------------ socket events
  onOpen(socket) {
    if (socket !== this.socket) return;
    this.attempt = 0;
    socket.wasOpen = true;
    this.lastFrameAt = Date.now();
    this.pingTimer = setInterval(() => this.keepAlive(), PING_EVERY_MS);
    this.setState("open");
  }

  onMessage(event) {
    this.lastFrameAt = Date.now();
    let frame;
    try {
      frame = JSON.parse(event.data);
    } catch {
      return;
    }
    if (frame.type === "pong") return;
    if (frame.type === "delta") {
      this.handlers.get(frame.id)?.delta(frame);
    } else if (frame.type === "done" || frame.type === "error") {
      if (this.handlers.has(frame.id)) {
        this.finish(frame.id, frame.type, frame);
      } else if (frame.type === "error") {  // e.g. a frame the server could not read (id null)
        this.dispatchEvent(new CustomEvent("orphan", { detail: frame }));
      }
    }
  }

  onClose(socket) {
    if (socket !== this.socket) return;
    clearInterval(this.pingTimer);
    this.socket = null;
    for (const id of [...this.handlers.keys()]) this.finish(id, "error", lostFrame(id));
    this.scheduleRetry();
    if (!socket.wasOpen) this.dispatchEvent(new CustomEvent("refused"));
  }

  keepAlive() {
    if (!this.isOpen) return;
    if (Date.now() - this.lastFrameAt > SILENCE_LIMIT_MS) {
      this.socket.close();  // onClose reconnects
      return;
    }
    this.send({ type: "ping" });
  }

  // ------------------------------------------------------------ helpers
  finish(id, kind, frame) {
    const handler = this.handlers.get(id);
    if (!handler) return;
    this.handlers.delete(id);
    handler[kind](frame);
  }

  scheduleRetry() {
    const base = Math.min(MAX_BACKOFF_MS, MIN_BACKOFF_MS * 2 ** this.attempt);
    const delay = base * (0.75 + Math.random() * 0.5);  // jitter: reloads don't stampede
    this.attempt += 1;
    this.retryAt = Date.now() + delay;
    this.retryTimer = setTimeout(() => this.connect(), delay);
    this.setState("waiting");
  }

  setState(state) {
    this.state = state;
    this.dispatchEvent(new CustomEvent("state", { detail: { state, retryAt: this.retryAt } }));
  }
}

function lostFrame(id) {
  return { type: "error", id, code: "connection_lost",
           message: "the connection to the server was lost before the answer finished" };
}

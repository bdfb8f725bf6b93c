// A minimal client of Duplex's WebSocket API (GET /v1/ws) that runs in a browser and in Node:
// it uses only the standard WebSocket API, so it has no dependency.
//
//     make serve                                              # in another terminal
//     node examples/ws_client.mjs "Why is the sky blue?"      # Node 22 or newer
//     node --experimental-websocket examples/ws_client.mjs    # Node 20 and 21
//
// In a page: `import { chat } from "./ws_client.mjs"`. DUPLEX_URL overrides the server
// (default http://127.0.0.1:8000); DUPLEX_API_KEY travels inside the subprotocol list, because
// a browser cannot set headers on a WebSocket (never in the URL, where logs would keep it).
// docs/websocket.md describes every frame.

/**
 * Ask one question; `onText` gets each piece of the answer as it arrives.
 * Resolves with the `done` frame (usage, timings); rejects on an `error` frame or a lost socket.
 */
export function chat(baseUrl, prompt, { apiKey, maxTokens = 64, onText = () => {} } = {}) {
  const url = new URL("/v1/ws", baseUrl.replace(/^http/, "ws"));
  const protocols = ["duplex.v1", ...(apiKey ? [`duplex.key.${base64url(apiKey)}`] : [])];
  return new Promise((resolve, reject) => {
    const socket = new WebSocket(url, protocols);
    socket.onopen = () => socket.send(JSON.stringify({
      type: "chat", id: "q1", max_tokens: maxTokens, temperature: 0,
      messages: [{ role: "user", content: prompt }],
    }));
    socket.onmessage = (event) => {
      const frame = JSON.parse(event.data);
      if (frame.type === "delta") onText(frame.text);
      if (frame.type === "done") { socket.close(); resolve(frame); }
      if (frame.type === "error") {
        socket.close();
        reject(new Error(`${frame.code}: ${frame.message}`));
      }
    };
    socket.onerror = () => reject(new Error(`cannot talk to ${url.origin}${url.pathname}`));
    socket.onclose = () => reject(new Error("the server closed the socket"));  // no-op once settled
  });
}

function base64url(text) {
  const binary = Array.from(new TextEncoder().encode(text), (b) => String.fromCharCode(b)).join("");
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

async function main() {
  if (typeof WebSocket === "undefined") {
    console.error("this Node has no global WebSocket: use Node 22+, or run Node 20/21 with "
      + "--experimental-websocket");
    return 2;
  }
  const baseUrl = process.env.DUPLEX_URL ?? "http://127.0.0.1:8000";
  const prompt = process.argv.slice(2).join(" ") || "Why is the sky blue?";
  try {
    const done = await chat(baseUrl, prompt, {
      apiKey: process.env.DUPLEX_API_KEY,
      onText: (text) => process.stdout.write(text),
    });
    const { usage, timings } = done;
    console.log(`\n(finish: ${done.finish_reason}; ${usage.completion_tokens} tokens; `
      + `${usage.cached_tokens}/${usage.prompt_tokens} prompt tokens cached; `
      + `ttft ${timings.ttft_s.toFixed(3)} s; ${timings.tokens_per_s.toFixed(1)} tokens/s)`);
    return 0;
  } catch (error) {
    console.error(`\nerror ${error.message}`);
    return 1;
  }
}

// Run main() only as a script under Node, never when imported (in a page or a test).
const isScript = typeof process !== "undefined" && process.argv?.[1]
  && decodeURIComponent(new URL(import.meta.url).pathname) === process.argv[1];
if (isScript) process.exitCode = await main();

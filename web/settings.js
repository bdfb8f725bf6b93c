// The settings dialog: system prompt and sampling fields, kept in localStorage.
//
// `requestFields()` gives the sampling fields of a `chat` frame (frontend/protocol.py
// SamplingFields). The speculation switch is enabled only when /v1/status says the server
// takes a per-request choice (`speculation.per_request`); otherwise it shows the server's mode.

const STORAGE_KEY = "duplex.settings.v1";
export const DEFAULTS = Object.freeze({
  system: "", temperature: 0.7, topP: 0.9, maxTokens: 512, speculation: true,
});

export class Settings {
  constructor(dialog) {
    this.dialog = dialog;
    this.form = dialog.querySelector("form");
    this.values = { ...DEFAULTS, ...load() };
    this.speculationAllowed = false;
    this.fill();
    this.form.addEventListener("input", () => this.read());
    dialog.querySelector("[data-action=reset]").addEventListener("click", () => {
      this.values = { ...DEFAULTS };
      this.fill();
      save(this.values);
    });
  }

  open() {
    this.dialog.showModal();
  }

  /** The sampling fields of the next chat frame. */
  requestFields() {
    const v = this.values;
    const fields = { temperature: v.temperature, top_p: v.topP };
    if (v.maxTokens !== null) fields.max_tokens = v.maxTokens;  // unset: the rest of the context
    if (this.speculationAllowed) fields.speculate = v.speculation;  // SamplingFields.speculate
    return fields;
  }

  /** The system message to put first, or null. */
  systemMessage() {
    const text = this.values.system.trim();
    return text ? { role: "system", content: text } : null;
  }

  /** Adapts the controls to what the server reports (a /v1/status snapshot). */
  applyServer(snapshot) {
    const spec = snapshot.speculation || {};
    const mode = spec.mode || "off";
    this.speculationAllowed = mode !== "off" && spec.per_request === true;
    const toggle = this.form.elements.speculation;
    toggle.disabled = !this.speculationAllowed;
    toggle.checked = this.speculationAllowed ? this.values.speculation : mode !== "off";
    this.dialog.querySelector("[data-field=speculation-note]").textContent = mode === "off"
      ? "Off on this server (start it with --speculation ngram, draft or self)."
      : this.speculationAllowed ? `Server mode: ${mode}.`
      : `On for every request (server mode: ${mode}); this server takes no per-request switch.`;
    if (snapshot.maxModelLen) this.form.elements.maxTokens.max = String(snapshot.maxModelLen);
  }

  fill() {
    const { elements } = this.form;
    elements.system.value = this.values.system;
    elements.temperature.value = String(this.values.temperature);
    elements.topP.value = String(this.values.topP);
    elements.maxTokens.value = this.values.maxTokens === null ? "" : String(this.values.maxTokens);
    if (this.speculationAllowed) elements.speculation.checked = this.values.speculation;
    this.showOutputs();
  }

  read() {
    const { elements } = this.form;
    const maxTokens = parseInt(elements.maxTokens.value, 10);
    this.values = {
      system: elements.system.value,
      temperature: Number(elements.temperature.value),
      topP: Number(elements.topP.value),
      maxTokens: Number.isFinite(maxTokens) && maxTokens >= 1 ? maxTokens : null,
      speculation: this.speculationAllowed ? elements.speculation.checked : this.values.speculation,
    };
    this.showOutputs();
    save(this.values);
  }

  showOutputs() {
    for (const output of this.form.querySelectorAll("output[data-for]")) {
      output.value = Number(this.values[output.dataset.for]).toFixed(2);
    }
  }
}

function load() {
  try {
    const stored = JSON.parse(localStorage.getItem(STORAGE_KEY) || "{}");
    return Object.fromEntries(Object.entries(stored).filter(([k, v]) =>
      k in DEFAULTS && (typeof v === typeof DEFAULTS[k] || (k === "maxTokens" && v === null))));
  } catch {
    return {};
  }
}

function save(values) {
  try {
    localStorage.setItem(STORAGE_KEY, JSON.stringify(values));
  } catch {
    // storage may be full or disabled: settings then last for this page only
  }
}

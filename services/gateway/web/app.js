// The gateway's web page: pick or drop a picture (prescaled in the browser to
// a configurable largest side), ask, watch the answer stream in over the
// OpenAI-compatible API, with token counts, timings and whether the image came
// from the cache. Plain JS, no libraries.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "vlm.apiKey";      // sessionStorage: this tab only
const SIDE_STORAGE = "vlm.maxSide";    // localStorage: a preference

const state = {
  model: null,
  messages: [],        // the conversation so far, OpenAI message objects
  image: null,         // {dataUrl, info} waiting to be sent with the next question
  controller: null,    // AbortController of the running request
};

function setState(name) { document.body.dataset.state = name; }

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
  if (text) setState("error");
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// An HTTP error in plain words.
function explain(status, body) {
  const detail = body && body.error && body.error.message ? body.error.message : "";
  switch (status) {
    case 400: return "The server could not use this request: " + detail;
    case 401: return "The API key is missing or wrong. Enter a valid key above.";
    case 404: return "Not found: " + detail;
    case 413: return "The picture is too large to upload. Lower the largest side and try again.";
    case 429: return "The server is busy with other requests. Try again in a moment.";
    case 503: return "The model is not ready yet (it may still be starting). Try again shortly. " + detail;
    case 504: return "The answer took too long and was stopped by the server.";
    default: return "Something went wrong (HTTP " + status + "). " + detail;
  }
}

function askForKey() {
  $("key-form").hidden = false;
  $("key").focus();
}

async function loadModel() {
  try {
    const res = await fetch("/v1/models", { headers: headers() });
    if (res.status === 401) {
      $("model").textContent = "API key needed";
      askForKey();
      return;
    }
    const body = await res.json();
    if (!res.ok) throw new Error(explain(res.status, body));
    state.model = body.data[0].id;
    $("model").textContent = "model " + state.model;
    $("key-form").hidden = true;
  } catch (e) {
    $("model").textContent = "not connected";
    showError("Cannot reach the server: " + e.message);
  }
}

// --- pictures ------------------------------------------------------------------

function maxSide() {
  const v = parseInt($("max-side").value, 10);
  return Number.isFinite(v) && v >= 64 ? v : 1024;
}

function readAsDataUrl(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

function loadImage(url) {
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => resolve(img);
    img.onerror = () => reject(new Error("this file is not a picture the browser can read"));
    img.src = url;
  });
}

// The picture as a data URL, scaled down (never up) so its largest side is at
// most maxSide(): large photos upload fast and cost fewer image tokens.
async function prepareImage(file) {
  if (!file.type.startsWith("image/")) throw new Error(file.name + " is not a picture");
  const url = URL.createObjectURL(file);
  try {
    const img = await loadImage(url);
    const w = img.naturalWidth, h = img.naturalHeight;
    const limit = maxSide();
    const scale = Math.min(1, limit / Math.max(w, h));
    if (scale === 1 && ["image/png", "image/jpeg", "image/webp"].includes(file.type)) {
      return { dataUrl: await readAsDataUrl(file), info: `${w}×${h}` };
    }
    const cw = Math.max(1, Math.round(w * scale)), ch = Math.max(1, Math.round(h * scale));
    const canvas = document.createElement("canvas");
    canvas.width = cw;
    canvas.height = ch;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff";  // transparent areas become white, not black
    ctx.fillRect(0, 0, cw, ch);
    ctx.drawImage(img, 0, 0, cw, ch);
    const dataUrl = canvas.toDataURL("image/jpeg", 0.92);
    return { dataUrl, info: scale < 1 ? `${w}×${h} → ${cw}×${ch}` : `${w}×${h}` };
  } finally {
    URL.revokeObjectURL(url);
  }
}

async function takeFile(file) {
  if (!file) return;
  showError("");
  try {
    state.image = await prepareImage(file);
    $("preview-img").src = state.image.dataUrl;
    $("preview-info").textContent = state.image.info;
    $("preview").hidden = false;
  } catch (e) {
    showError("Cannot use this file: " + e.message);
  }
}

function clearImage() {
  state.image = null;
  $("preview").hidden = true;
  $("preview-img").removeAttribute("src");
  $("file").value = "";
}

// --- conversation -----------------------------------------------------------

function addBubble(role, text, imageUrl) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  if (imageUrl) {
    const img = document.createElement("img");
    img.src = imageUrl;
    img.alt = "the picture sent";
    div.appendChild(img);
  }
  const answer = document.createElement("span");
  answer.className = "answer";
  answer.textContent = text;
  div.appendChild(answer);
  $("log").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function statsLine(usage, extra) {
  const parts = [];
  if (usage) {
    let prompt = `${usage.prompt_tokens} prompt tokens`;
    if (extra && extra.image_tokens) prompt += ` (${extra.image_tokens} for the image)`;
    const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
    if (cached) prompt += `, ${cached} cached`;
    parts.push(prompt, `${usage.completion_tokens} answer tokens`);
  }
  if (extra && extra.timings_ms) {
    const t = extra.timings_ms;
    parts.push(`first token ${Math.round(t.first_token)} ms`, `total ${Math.round(t.total)} ms`);
    if (t.decode > 0 && usage && usage.completion_tokens > 1) {
      parts.push(`${(usage.completion_tokens / (t.decode / 1000)).toFixed(1)} tokens/s`);
    }
  }
  if (extra && extra.images) {
    extra.images.forEach((im, i) => {
      const label = extra.images.length > 1 ? `image ${i + 1}` : "image";
      parts.push(im.cache_hit ? `${label} from cache (${im.cache})` : `${label} encoded (${Math.round(im.vision_ms)} ms)`);
    });
  }
  return parts.join(" · ");
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  setState(on ? "streaming" : $("error").hidden ? "idle" : "error");
}

// Reads an SSE body: calls onEvent(json) for each "data:" event until [DONE].
async function readEvents(body, onEvent) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let yielded = performance.now();
  for (;;) {
    // A fast stream keeps reads resolved, and awaiting them never leaves the
    // microtask queue: give the page (the Stop button, painting) a turn now and then.
    if (performance.now() - yielded > 30) {
      await new Promise((resolve) => setTimeout(resolve, 0));
      yielded = performance.now();
    }
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;  // comments (keep-alive) and other fields
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function send(event) {
  if (event) event.preventDefault();
  const question = $("prompt").value.trim();
  if (!question && !state.image) return;
  if (!state.model) await loadModel();
  if (!state.model) return;
  showError("");
  // Advanced: a JSON schema constrains the answer (response_format json_schema).
  let schema = null;
  const schemaText = $("json-schema").value.trim();
  if (schemaText) {
    try {
      schema = JSON.parse(schemaText);
    } catch (e) {
      showError("The JSON schema is not valid JSON: " + e.message);
      return;
    }
  }

  const content = [];
  if (state.image) content.push({ type: "image_url", image_url: { url: state.image.dataUrl } });
  content.push({ type: "text", text: question || "Describe this picture." });
  const userMessage = { role: "user", content };
  addBubble("user", question || "Describe this picture.", state.image && state.image.dataUrl);
  const bubble = addBubble("assistant", "");
  const answer = bubble.querySelector(".answer");
  $("prompt").value = "";
  clearImage();

  const maxTokens = parseInt($("max-tokens").value, 10);
  const request = {
    model: state.model,
    messages: state.messages.concat([userMessage]),
    stream: true,
    stream_options: { include_usage: true },
  };
  if (Number.isFinite(maxTokens) && maxTokens > 0) request.max_tokens = maxTokens;
  if (schema !== null) {
    request.response_format = {
      type: "json_schema", json_schema: { name: "answer", schema, strict: true },
    };
  }

  state.controller = new AbortController();
  busy(true);
  let text = "", usage = null, extra = null, failed = false;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request),
      signal: state.controller.signal,
    });
    if (!res.ok) {
      let body = null;
      try { body = await res.json(); } catch (_) { /* not JSON */ }
      if (res.status === 401) askForKey();
      throw new Error(explain(res.status, body));
    }
    await readEvents(res.body, (chunk) => {
      if (chunk.error) throw new Error(explain(0, chunk));
      if (chunk.usage) usage = chunk.usage;
      if (chunk.x_vlm) extra = chunk.x_vlm;
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          text += choice.delta.content;
          answer.append(choice.delta.content);  // a text node each: no copy of the whole
        }
      }
    });
  } catch (e) {
    if (e.name === "AbortError") {
      bubble.classList.add("stopped");
    } else {
      failed = true;
      bubble.remove();
      showError(e.message);
    }
  } finally {
    state.controller = null;
    busy(false);
  }
  if (failed) return;
  state.messages.push(userMessage, { role: "assistant", content: text });
  const stats = document.createElement("span");
  stats.className = "stats";
  stats.textContent = statsLine(usage, extra) || "stopped before the end";
  bubble.appendChild(stats);
  bubble.scrollIntoView({ block: "end" });
}

function stop() {
  if (state.controller) state.controller.abort();
}

function newChat() {
  stop();
  state.messages = [];
  $("log").replaceChildren();
  showError("");
  setState("idle");
}

// --- wiring --------------------------------------------------------------------

function init() {
  const params = new URLSearchParams(location.search);
  $("max-side").value = params.get("max_side") || localStorage.getItem(SIDE_STORAGE) || 1024;
  $("max-tokens").value = params.get("max_tokens") || 256;
  $("max-side").addEventListener("change", () => localStorage.setItem(SIDE_STORAGE, $("max-side").value));

  $("file").addEventListener("change", () => takeFile($("file").files[0]));
  $("remove-image").addEventListener("click", clearImage);
  const drop = $("drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    takeFile(e.dataTransfer.files[0]);
  });
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    showError("");
    loadModel();
  });
  loadModel();
}

init();

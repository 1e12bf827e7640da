// The score-map viewer: one image scored through POST /v1/models/{name}/score, its maps drawn over it.
// The overlay is a canvas of one pixel per cell, placed and stretched by CSS over the cells' boxes
// (MapGeometry: cell (i, j) is centred at center + (i, j) * stride in image pixels, pixel i centred
// at i), so large images cost nothing in script. Cells no pass scored (a diagonal shift's holes,
// NaN) are transparent. No build step, no library: plain modules of the browser.
"use strict";

const $ = (id) => document.getElementById(id);
const CELL_TOP_K = 5;
// matplotlib's viridis at 0, 1/8, ..., 1: as clients/heatmap.py draws.
const VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
  [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]];

const state = { models: [], card: null, file: null, response: null, scale: 0, cls: 0, lattice: null, map: null,
  undisplayable: false };
const PLACEHOLDER_SIDE = 4096; // the neutral canvas's longest side at most (a photo of any size keeps its shape)
window.scoremapViewer = state; // for the browser test and the curious

// --- the server ------------------------------------------------------------------------------------
function headers() {
  const token = $("token").value.trim();
  return token ? { Authorization: `Bearer ${token}` } : {};
}

async function call(url, options = {}) {
  const response = await fetch(url, { ...options, headers: { ...headers(), ...(options.headers || {}) } });
  const text = await response.text();
  let body = null;
  try { body = JSON.parse(text); } catch (_) { /* not JSON: a proxy's page, say */ }
  if (!response.ok) {
    throw new Error(body && body.error ? `${response.status} ${body.code}: ${body.error}` : `${response.status}: ${text}`);
  }
  return body;
}

async function loadModels() {
  try {
    state.models = (await call("/v1/models")).models;
  } catch (error) {
    return showError(error);
  }
  showError(null);
  $("model").replaceChildren(...state.models.map((m) => new Option(m.name, m.name)));
  chooseModel();
}

function chooseModel() {
  const model = state.models.find((m) => m.name === $("model").value);
  if (!model) return;
  state.card = model.card;
  $("scales").value = model.default_scale;
  const strides = model.output_strides.length ? model.output_strides : [model.output_stride];
  $("stride").replaceChildren(...strides.map((s) => new Option(s, s)));
  $("labels").replaceChildren(...model.card.labels.map((label) => new Option(label)));
}

async function score() {
  if (!state.file) return showError(new Error("choose or drop an image first"));
  const query = new URLSearchParams({ maps: "true", map_dtype: "float16", cell_top_k: CELL_TOP_K, top_k: 10,
    stride: $("stride").value, shift: $("shift").value, flip: $("flip").checked });
  if ($("scales").value.trim()) query.set("scales", $("scales").value.trim());
  const form = new FormData();
  form.append("image", state.file);
  showError(null);
  $("status").textContent = "scoring…";
  $("stage").dataset.state = "scoring";
  try {
    state.response = await call(`/v1/models/${encodeURIComponent($("model").value)}/score?${query}`,
      { method: "POST", body: form });
  } catch (error) {
    clearResults();
    $("stage").dataset.state = "error";
    $("status").textContent = "";
    return showError(error);
  }
  const r = state.response;
  if (state.undisplayable) placeholder();
  $("status").textContent = `${r.model}: ${r.image_width}×${r.image_height}, ${r.timings.total_ms.toFixed(0)} ms on ${r.execution_provider}`;
  $("scale").replaceChildren(...r.maps.map((m, i) => new Option(`${m.scale} px: ${m.height}×${m.width} cells`, i)));
  state.scale = r.maps.reduce((best, m, i) => (m.height * m.width > r.maps[best].height * r.maps[best].width ? i : best), 0);
  $("scale").value = state.scale;
  $("topk").replaceChildren(...r.top_k.map((t) => {
    const item = document.createElement("li");
    item.textContent = `${t.label} (${t.index}): ${(100 * t.probability).toFixed(1)}%`;
    item.onclick = () => chooseClass(t.index);
    return item;
  }));
  $("class").replaceChildren(...r.top_k.map((t) => new Option(`${t.label} (${(100 * t.probability).toFixed(1)}%)`, t.index)));
  $("results").hidden = false;
  chooseScale();
  chooseClass(r.top_k[0].index);
}

function clearResults() { // an error: nothing of the previous image stays on screen under it
  state.response = null;
  state.lattice = null;
  state.map = null;
  for (const id of ["topk", "class", "scale"]) $(id).replaceChildren();
  $("results").hidden = true;
  $("stage").hidden = true;
  $("note").hidden = true;
  $("cell").textContent = "";
}

function placeholder() { // the browser cannot show this image (TIFF, say): a neutral canvas of its size instead
  const r = state.response, shrink = Math.min(1, PLACEHOLDER_SIDE / Math.max(r.image_width, r.image_height));
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, Math.round(r.image_width * shrink));
  canvas.height = Math.max(1, Math.round(r.image_height * shrink));
  const context = canvas.getContext("2d");
  context.fillStyle = "#9e9e9e";
  context.fillRect(0, 0, canvas.width, canvas.height);
  $("photo").src = canvas.toDataURL("image/png");
  const kind = state.file.type.split("/")[1] || (state.file.name.match(/\.([^.]+)$/) || [])[1];
  const what = kind ? `${kind.toUpperCase()} images` : "this image";
  $("note").textContent = `this browser cannot display ${what}: the map is drawn over a gray canvas of the ` +
    `image's size (${r.image_width}×${r.image_height}); the scores are the image's own`;
  $("note").hidden = false;
}

function showError(error) {
  $("error").hidden = !error;
  $("error").textContent = error ? error.message : "";
}

// --- tensors ----------------------------------------------------------------------------------------
const HALF = (() => { // every float16 bit pattern as float32
  const table = new Float32Array(65536);
  for (let h = 0; h < 65536; h++) {
    const sign = h & 0x8000 ? -1 : 1, exponent = (h >> 10) & 0x1f, fraction = h & 0x3ff;
    table[h] = exponent === 0 ? sign * 2 ** -14 * (fraction / 1024)
      : exponent === 31 ? (fraction ? NaN : sign * Infinity)
      : sign * 2 ** (exponent - 15) * (1 + fraction / 1024);
  }
  return table;
})();

function decode(tensor) { // {dtype, shape, data: base64 little-endian} -> a typed array
  const bytes = Uint8Array.from(atob(tensor.data), (c) => c.charCodeAt(0));
  if (tensor.dtype === "float16") return Float32Array.from(new Uint16Array(bytes.buffer), (v) => HALF[v]);
  if (tensor.dtype === "float32") return new Float32Array(bytes.buffer);
  if (tensor.dtype === "int32") return new Int32Array(bytes.buffer);
  throw new Error(`cannot read a ${tensor.dtype} tensor`);
}

function chooseScale() {
  const m = state.response.maps[state.scale];
  const scores = decode(m.scores);
  const [classes, h, w] = m.scores.shape, cells = h * w;
  // Per-cell log-sum-exp over classes, so any class's map is its per-cell probability (softmax), as
  // clients/heatmap.py draws it; a lattice already of probabilities is taken as it is.
  let logits = false;
  for (const v of scores) if (v < 0 || v > 1) { logits = true; break; }
  const logZ = new Float32Array(cells);
  if (logits) {
    for (let c = 0; c < cells; c++) {
      let max = -Infinity;
      for (let k = 0; k < classes; k++) { const v = scores[k * cells + c]; if (v > max) max = v; }
      let sum = 0;
      for (let k = 0; k < classes; k++) sum += Math.exp(scores[k * cells + c] - max);
      logZ[c] = max + Math.log(sum);
    }
  }
  const channel = m.classes.length ? m.classes : null;
  state.lattice = { scores, logits, logZ, classes, h, w, channel, geometry: m.geometry,
    topIndices: m.cell_top_k_indices.shape.length ? decode(m.cell_top_k_indices) : null,
    topK: m.cell_top_k_indices.shape.length ? m.cell_top_k_indices.shape[0] : 0 };
  if (state.map) draw();
}

function classMap(index) { // Float32Array [h * w] of class `index`'s per-cell probability (NaN: unscored)
  const l = state.lattice, cells = l.h * l.w;
  const k = l.channel ? l.channel.indexOf(index) : index;
  const map = new Float32Array(cells);
  for (let c = 0; c < cells; c++) {
    const v = l.scores[k * cells + c];
    map[c] = l.logits ? Math.exp(v - l.logZ[c]) : v;
  }
  return map;
}

function chooseClass(index) {
  state.cls = Number(index);
  if (![...$("class").options].some((o) => Number(o.value) === state.cls)) {
    $("class").append(new Option(`${state.card.labels[state.cls] || state.cls} (searched)`, state.cls));
  }
  $("class").value = state.cls;
  draw();
}

// --- drawing ---------------------------------------------------------------------------------------
function viridis(t) {
  const x = Math.min(Math.max(t, 0), 1) * (VIRIDIS.length - 1), low = Math.min(Math.floor(x), VIRIDIS.length - 2);
  const f = x - low;
  return VIRIDIS[low].map((c, i) => Math.round(c * (1 - f) + VIRIDIS[low + 1][i] * f));
}

function draw() {
  const l = state.lattice;
  state.map = classMap(state.cls);
  let peak = 0;
  for (const v of state.map) if (v > peak) peak = v; // NaN compares false: holes are skipped
  const canvas = $("overlay");
  canvas.width = l.w;
  canvas.height = l.h;
  const context = canvas.getContext("2d");
  const pixels = context.createImageData(l.w, l.h);
  state.map.forEach((v, c) => {
    if (Number.isNaN(v)) return; // a hole: left transparent
    const [r, g, b] = viridis(peak > 0 ? v / peak : 0);
    pixels.data.set([r, g, b, 255], 4 * c);
  });
  context.putImageData(pixels, 0, 0);
  place(canvas, l.geometry.center_x - l.geometry.stride_x / 2, l.geometry.center_y - l.geometry.stride_y / 2,
    l.w * l.geometry.stride_x, l.h * l.geometry.stride_y);
  canvas.style.opacity = $("opacity").value;
  $("stage").hidden = false;
  $("stage").dataset.state = "rendered";
  $("stage").dataset.cls = state.cls;
}

function place(element, left, top, width, height) { // image pixels (pixel i centred at i) -> % of the image
  const r = state.response;
  element.style.left = `${(100 * (left + 0.5)) / r.image_width}%`;
  element.style.top = `${(100 * (top + 0.5)) / r.image_height}%`;
  element.style.width = `${(100 * width) / r.image_width}%`;
  element.style.height = `${(100 * height) / r.image_height}%`;
}

function hover(event) {
  const l = state.lattice, r = state.response, g = l && l.geometry;
  if (!g) return;
  const rect = $("photo").getBoundingClientRect();
  const x = ((event.clientX - rect.left) / rect.width) * r.image_width - 0.5;
  const y = ((event.clientY - rect.top) / rect.height) * r.image_height - 0.5;
  const i = Math.round((y - g.center_y) / g.stride_y), j = Math.round((x - g.center_x) / g.stride_x);
  if (i < 0 || j < 0 || i >= l.h || j >= l.w) { $("box").hidden = true; $("cell").textContent = ""; return; }
  const cy = g.center_y + i * g.stride_y, cx = g.center_x + j * g.stride_x, c = i * l.w + j;
  place($("box"), cx - g.box_width / 2, cy - g.box_height / 2, g.box_width, g.box_height);
  $("box").hidden = false;
  const lines = [`cell (${i}, ${j}), centre (${cx.toFixed(1)}, ${cy.toFixed(1)}) px, receptive field ${g.box_width.toFixed(0)}×${g.box_height.toFixed(0)} px`];
  if (Number.isNaN(state.map[c])) lines.push("no pass scored this cell (a diagonal shift's hole)");
  else {
    lines.push(`${state.card.labels[state.cls] || state.cls}: ${(100 * state.map[c]).toFixed(1)}%`);
    for (let k = 0; k < l.topK; k++) {
      const index = l.topIndices[k * l.h * l.w + c];
      if (index < 0) continue;
      const p = l.logits ? Math.exp(l.scores[(l.channel ? l.channel.indexOf(index) : index) * l.h * l.w + c] - l.logZ[c]) : NaN;
      lines.push(`  ${k + 1}. ${state.card.labels[index] || index}${Number.isNaN(p) ? "" : `: ${(100 * p).toFixed(1)}%`}`);
    }
  }
  $("cell").textContent = lines.join("\n");
}

// --- downloads -------------------------------------------------------------------------------------
function save(blob, name) {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = name;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

function baseName() {
  return `${(state.file.name || "image").replace(/\.[^.]*$/, "")}_${state.cls}`;
}

function downloadPng() { // the image with its overlay, at the image's own size (the browser scales the lattice)
  const r = state.response, g = state.lattice.geometry, photo = $("photo");
  const canvas = document.createElement("canvas");
  canvas.width = r.image_width;
  canvas.height = r.image_height;
  const context = canvas.getContext("2d");
  context.drawImage(photo, 0, 0, r.image_width, r.image_height);
  context.globalAlpha = Number($("opacity").value);
  context.imageSmoothingEnabled = false;
  context.drawImage($("overlay"), g.center_x - g.stride_x / 2 + 0.5, g.center_y - g.stride_y / 2 + 0.5,
    state.lattice.w * g.stride_x, state.lattice.h * g.stride_y);
  canvas.toBlob((blob) => save(blob, `${baseName()}.png`), "image/png");
}

function downloadNpy() { // the class's [h, w] float32 map (NaN: holes), in NumPy's .npy format 1.0
  const l = state.lattice;
  let header = `{'descr': '<f4', 'fortran_order': False, 'shape': (${l.h}, ${l.w}), }`;
  header += " ".repeat(63 - ((10 + header.length) % 64)) + "\n"; // magic, version and length are 10 bytes
  const prefix = new Uint8Array(10 + header.length);
  prefix.set([0x93, 78, 85, 77, 80, 89, 1, 0, header.length & 0xff, header.length >> 8]);
  prefix.set(new TextEncoder().encode(header), 10);
  save(new Blob([prefix, state.map]), `${baseName()}.npy`);
}

// --- wiring ----------------------------------------------------------------------------------------
function choose(file) {
  if (!file) return;
  state.file = file;
  state.undisplayable = false;
  state.response = null;
  $("note").hidden = true;
  $("photo").src = URL.createObjectURL(file);
  score();
}

function photoFailed() { // the browser cannot decode the chosen file; the server may still score it
  if (!$("photo").src.startsWith("blob:")) return; // the placeholder itself
  state.undisplayable = true;
  if (state.response) placeholder(); // scored before the browser gave up on the image
}

document.addEventListener("DOMContentLoaded", () => {
  loadModels();
  $("model").onchange = chooseModel;
  $("token").onchange = loadModels; // a server with a token answers the model list only with it
  $("controls").onsubmit = (event) => { event.preventDefault(); score(); };
  $("file").onchange = () => choose($("file").files[0]);
  const drop = $("drop");
  drop.ondragover = (event) => { event.preventDefault(); drop.classList.add("over"); };
  drop.ondragleave = () => drop.classList.remove("over");
  drop.ondrop = (event) => { event.preventDefault(); drop.classList.remove("over"); choose(event.dataTransfer.files[0]); };
  $("class").onchange = () => chooseClass($("class").value);
  $("search").onchange = () => {
    const index = state.card.labels.indexOf($("search").value);
    if (index >= 0) chooseClass(index);
    else showError(new Error(`no class named "${$("search").value}": pick one of the suggestions`));
  };
  $("scale").onchange = () => { state.scale = Number($("scale").value); chooseScale(); };
  $("opacity").oninput = () => { $("overlay").style.opacity = $("opacity").value; };
  $("png").onclick = downloadPng;
  $("npy").onclick = downloadNpy;
  $("photo").onerror = photoFailed;
  $("stage").onmousemove = hover;
  $("stage").onmouseleave = () => { $("box").hidden = true; };
});

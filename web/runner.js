// One ONNX run in onnxruntime-web, driven by harness/backends/onnxruntime_web.py through Playwright.
// Everything comes from the loopback server that served this page: onnxruntime-web's files
// (/ort/), the model (/model.onnx), the files it keeps tensors in (/external/N) and each input's
// raw bytes (/input/N); each output's raw bytes are posted back to /output/N. Only names, dtypes
// and shapes cross the page boundary as JSON.

const ARRAYS = {
  float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array,
  int8: Int8Array, uint8: Uint8Array, bool: Uint8Array, float16: Uint16Array,
};

// What the browser offers: the adapter onnxruntime-web's WebGPU provider would get by default.
async function adapterInfo() {
  if (!navigator.gpu) return { error: "navigator.gpu is undefined (WebGPU not exposed by this browser)" };
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter) return { error: "navigator.gpu.requestAdapter() returned null (no WebGPU adapter)" };
  const info = adapter.info || {};
  const limits = {};
  for (const k of ["maxBufferSize", "maxStorageBufferBindingSize", "maxComputeWorkgroupStorageSize",
                   "maxComputeInvocationsPerWorkgroup", "maxComputeWorkgroupSizeX",
                   "maxComputeWorkgroupsPerDimension", "maxStorageBuffersPerShaderStage"]) {
    limits[k] = adapter.limits[k];
  }
  return {
    vendor: info.vendor, architecture: info.architecture, device: info.device,
    description: info.description, features: [...adapter.features].sort(),
    shader_f16: adapter.features.has("shader-f16"), limits,
  };
}

async function bytesOf(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`GET ${url}: HTTP ${response.status}`);
  return response.arrayBuffer();
}

function tensorOf(ort, spec, buffer) {
  const Array_ = ARRAYS[spec.dtype];
  if (!Array_) throw new Error(`input ${spec.name}: dtype ${spec.dtype} has no onnxruntime-web tensor type`);
  return new ort.Tensor(spec.dtype, new Array_(buffer), spec.dims);
}

async function postOutput(url, tensor) {
  const data = tensor.data;  // a typed array on the CPU (outputs are downloaded by default)
  const body = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  const response = await fetch(url, { method: "POST", body });
  if (!response.ok) throw new Error(`POST ${url}: HTTP ${response.status}`);
}

// A lost WebGPU device ends the run with the browser's reason instead of a hang.
function deviceLost(ort) {
  const device = ort.env.webgpu && ort.env.webgpu.device;
  if (!device || !device.lost) return new Promise(() => {});
  return device.lost.then((info) => {
    throw new Error(`WebGPU device lost (${info.reason}): ${info.message}`);
  });
}

window.kokoroRun = async function kokoroRun(cfg) {
  const clock = () => performance.now() / 1000;
  const times = {};
  let t = clock();
  const ort = await import(`/ort/${cfg.bundle}`);
  ort.env.wasm.wasmPaths = "/ort/";
  ort.env.wasm.numThreads = cfg.threads;
  ort.env.logLevel = cfg.verbose ? "verbose" : "warning";
  const adapter = cfg.ep === "webgpu" ? await adapterInfo() : null;
  if (adapter && adapter.error) throw new Error(adapter.error);
  const model = new Uint8Array(await bytesOf("/model.onnx"));
  times.fetch_s = clock() - t;
  t = clock();
  const session = await ort.InferenceSession.create(model, {
    executionProviders: [cfg.ep],
    graphOptimizationLevel: "all",
    logSeverityLevel: cfg.verbose ? 0 : 2,
    logVerbosityLevel: 0,
    // tensors kept beside the model (an exporter's model.onnx.data), fetched from the server by the session
    externalData: (cfg.external || []).map((e) => ({ path: e.path, data: e.url })),
  });
  times.session_s = clock() - t;
  const feeds = {};
  for (const [i, spec] of cfg.inputs.entries()) {
    feeds[spec.name] = tensorOf(ort, spec, await bytesOf(`/input/${i}`));
  }
  t = clock();
  const results = await Promise.race([session.run(feeds), deviceLost(ort)]);
  times.run_s = clock() - t;
  const outputs = [];
  for (const [i, name] of session.outputNames.entries()) {
    const tensor = results[name];
    await postOutput(`${cfg.outputs || "/output/"}${i}`, tensor);
    outputs.push({ name, dtype: tensor.type, dims: Array.from(tensor.dims) });
  }
  await session.release();
  return { outputs, adapter, times, input_names: session.inputNames };
};
window.kokoroAdapter = adapterInfo;
window.kokoroReady = true;

// Device mode (runner.html?device), on the user's own phone or laptop: no harness drives this page,
// so it asks the server for the next run (/next), runs it and posts its answer (/answer/ID) with
// the device's user agent, adapter and onnxruntime's placement lines, until the tab is closed.
// It posts its user agent and adapter (/about/ID) once, and holds an event stream (/alive?page=ID)
// for as long as it is open: a tab closed or crashed mid-run closes that connection, and the
// harness reads the run as CRASHED in seconds instead of waiting for the run limit (the browser,
// not this script, holds the connection, so a long synchronous run does not drop it).
const KEPT_LOG = /\[[WEF]:onnxruntime|Node placements|placed on \[|VerifyEachNodeIsAssignedToAnEp\]\s{3}|kernel not found in registries/;

function keepConsole() {
  const kept = [];
  for (const level of ["log", "info", "warn", "error", "debug"]) {
    const original = console[level].bind(console);
    console[level] = (...args) => {
      const line = args.map(String).join(" ");
      if (KEPT_LOG.test(line)) kept.push(line);
      original(...args);
    };
  }
  return kept;
}

function show(text) {
  document.body.textContent = text;
}

// The page's event stream, open before it takes a run (or given up on after 5 s: its runs then
// have only the run limit).
function holdAlive(page) {
  return new Promise((resolve) => {
    const alive = new EventSource(`/alive?page=${page}`);
    alive.addEventListener("open", () => resolve(alive), { once: true });
    setTimeout(() => resolve(alive), 5000);
  });
}

async function deviceLoop() {
  const kept = keepConsole();
  // not crypto.randomUUID: a page on a LAN address over http is not a secure context
  const page = `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
  let done = 0;
  show("kokoro-parity: waiting for runs");
  window.kokoroAlive = await holdAlive(page);
  // who this page is, for a run it takes and never answers (a crash, a hang)
  const about = { user_agent: navigator.userAgent, adapter: await adapterInfo() };
  await fetch(`/about/${page}`, { method: "POST", body: JSON.stringify(about) }).catch(() => {});
  for (;;) {
    let job = {};
    try {
      job = await (await fetch(`/next?page=${page}`, { cache: "no-store" })).json();
    } catch (e) {
      show(`kokoro-parity: ${done} run(s) done; the harness is not answering (${e.message})`);
    }
    if (!job.id) {
      await new Promise((resolve) => setTimeout(resolve, 500));
      continue;
    }
    show(`kokoro-parity: running ${job.id} (${job.cfg.ep})`);
    kept.length = 0;
    const about = { user_agent: navigator.userAgent, adapter: await adapterInfo() };
    let body;
    try {
      body = { ...about, answer: await window.kokoroRun(job.cfg), console: kept.slice() };
    } catch (e) {
      body = { ...about, error: String(e && e.message || e), console: kept.slice() };
    }
    await fetch(`/answer/${job.id}`, { method: "POST", body: JSON.stringify(body) });
    done += 1;
    show(`kokoro-parity: ${done} run(s) done; waiting for the next`);
  }
}

if (new URLSearchParams(location.search).has("device")) {
  window.addEventListener("load", () => deviceLoop());
}

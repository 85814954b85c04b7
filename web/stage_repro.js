// Runs stage.onnx on the inputs in onnxruntime-web (from ./ort/) with the provider that judged the
// item and compares its output with the float64 expected output (verdict.mjs): "reproduced" or
// "fixed", on the page, its console and `window.reproVerdict`. A stage bundle's repro.js, copied
// from web/stage_repro.js by harness/port/web_repro.py.
import { runStage } from "./verdict.mjs";

const out = document.getElementById("out");
function say(line) { out.textContent += line + "\n"; console.log(line); }

async function bytes(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`GET ${url}: HTTP ${response.status}`);
  return response.arrayBuffer();
}

async function main() {
  const spec = await (await fetch("inputs.json")).json();
  const ort = await import(`./ort/${spec.bundle}`);
  ort.env.wasm.wasmPaths = new URL("ort/", location.href).href;
  ort.env.wasm.numThreads = 1;
  say(`stage ${spec.stage}: onnxruntime-web ${spec.ort_web_version}, ${spec.execution_provider} provider`);
  const { line, ...verdict } = await runStage(ort, spec, bytes, spec.execution_provider);
  say(line);
  window.reproVerdict = { ...verdict, user_agent: navigator.userAgent };
}

main().catch((e) => {
  say(`cannot run here: ${e.message}`);
  window.reproVerdict = { error: String(e.message || e) };
});

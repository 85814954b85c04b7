// Runs stage.onnx in Node.js on onnxruntime-web's WebAssembly build (./ort/ort.node.min.mjs, which
// imports onnxruntime-common from ./node_modules) and compares its output with the float64 expected
// output as the page does (verdict.mjs): `node repro.mjs`, exit 1 reproduced, 0 fixed, 2 cannot run
// here. The wasm kernels, whichever provider judged the item. A stage bundle's repro.mjs, copied
// from web/stage_repro_node.mjs by harness/port/web_repro.py.
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import { runStage } from "./verdict.mjs";

const HERE = dirname(fileURLToPath(import.meta.url));

function bytes(name) {
  const b = readFileSync(join(HERE, name));
  return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength);
}

async function main() {
  const spec = JSON.parse(readFileSync(join(HERE, "inputs.json"), "utf8"));
  const ort = await import("./ort/ort.node.min.mjs");
  ort.env.wasm.numThreads = 1;
  console.log(`stage ${spec.stage}: onnxruntime-web ${spec.ort_web_version} in Node.js ${process.version}, ` +
              `wasm provider (the item was judged on ${spec.execution_provider})`);
  const verdict = await runStage(ort, spec, async (name) => bytes(name), "wasm");
  console.log(verdict.line);
  process.exitCode = verdict.reproduced ? 1 : 0;
}

main().catch((e) => {
  console.log(`cannot run here: ${e.message}`);
  process.exitCode = 2;
});

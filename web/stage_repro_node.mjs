// Runs stage.onnx in Node.js on onnxruntime-web's WebAssembly build (./ort/ort.node.min.mjs, which
// imports onnxruntime-common from ./node_modules) and compares its output with the float64 expected
// output as repro.js does in a browser: `node repro.mjs`, exit 1 reproduced (rel L2 over the
// tolerance, or not finite), 0 fixed, 2 cannot run here. The wasm kernels, whichever provider
// judged the item. A stage bundle's repro.mjs, copied from web/stage_repro_node.mjs by
// harness/port/web_repro.py.
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const HERE = dirname(fileURLToPath(import.meta.url));
const ARRAYS = {
  float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array,
  int8: Int8Array, uint8: Uint8Array, bool: Uint8Array, float16: Uint16Array,
};

function bytes(name) {
  const b = readFileSync(join(HERE, name));
  return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength);
}

function half(h) {  // an IEEE half's bits as a number (float16 outputs come back as Uint16Array)
  const e = (h >> 10) & 31, f = h & 1023, s = h >> 15 ? -1 : 1;
  if (e === 0) return s * f * 2 ** -24;
  if (e === 31) return f ? NaN : s * Infinity;
  return s * (1 + f / 1024) * 2 ** (e - 15);
}

async function main() {
  const spec = JSON.parse(readFileSync(join(HERE, "inputs.json"), "utf8"));
  const ort = await import("./ort/ort.node.min.mjs");
  ort.env.wasm.numThreads = 1;
  console.log(`stage ${spec.stage}: onnxruntime-web ${spec.ort_web_version} in Node.js ${process.version}, ` +
              `wasm provider (the item was judged on ${spec.execution_provider})`);
  const session = await ort.InferenceSession.create(new Uint8Array(bytes("stage.onnx")), {
    executionProviders: ["wasm"], graphOptimizationLevel: "all",
  });
  const feeds = {};
  for (const x of spec.inputs) {
    feeds[x.name] = new ort.Tensor(x.dtype, new ARRAYS[x.dtype](bytes(x.file)), x.dims);
  }
  const result = (await session.run(feeds, [spec.output]))[spec.output];
  const got = result.type === "float16" && result.data instanceof Uint16Array
    ? Array.from(result.data, half) : result.data;
  const expected = new Float64Array(bytes(spec.expected.file));
  if (got.length !== expected.length) {
    throw new Error(`output ${spec.output}: ${got.length} values, expected ${expected.length}`);
  }
  let num = 0, den = 0;
  for (let i = 0; i < expected.length; i++) {
    const d = Number(got[i]) - expected[i];
    num += d * d;
    den += expected[i] * expected[i];
  }
  const rel = Math.sqrt(num) / Math.sqrt(den);
  const reproduced = !Number.isFinite(rel) || rel > spec.tolerance;
  console.log(`stage ${spec.stage}: rel_l2 ${rel.toExponential(3)} against the reference ` +
              `(tolerance ${spec.tolerance.toExponential(3)}): ${reproduced ? "reproduced" : "fixed"}`);
  process.exitCode = reproduced ? 1 : 0;
}

main().catch((e) => {
  console.log(`cannot run here: ${e.message}`);
  process.exitCode = 2;
});

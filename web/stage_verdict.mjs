// What a stage bundle's browser page (repro.js) and Node.js script (repro.mjs) share: the input
// tensors from their bytes, one run of the stage, and its verdict against the float64 expected
// output ("reproduced": rel L2 over the tolerance, or not finite; else "fixed"). A stage bundle's
// verdict.mjs, copied from web/stage_verdict.mjs by harness/port/web_repro.py.
const ARRAYS = {
  float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array,
  int8: Int8Array, uint8: Uint8Array, bool: Uint8Array, float16: Uint16Array,
};

function half(h) {  // an IEEE half's bits as a number (float16 outputs come back as Uint16Array)
  const e = (h >> 10) & 31, f = h & 1023, s = h >> 15 ? -1 : 1;
  if (e === 0) return s * f * 2 ** -24;
  if (e === 31) return f ? NaN : s * Infinity;
  return s * (1 + f / 1024) * 2 ** (e - 15);
}

// `bytes(name)`: a bundle file's ArrayBuffer (fetched in a page, read from disk in Node.js).
export async function runStage(ort, spec, bytes, executionProvider) {
  const session = await ort.InferenceSession.create(new Uint8Array(await bytes("stage.onnx")), {
    executionProviders: [executionProvider], graphOptimizationLevel: "all",
  });
  const feeds = {};
  for (const x of spec.inputs) {
    feeds[x.name] = new ort.Tensor(x.dtype, new ARRAYS[x.dtype](await bytes(x.file)), x.dims);
  }
  const result = (await session.run(feeds, [spec.output]))[spec.output];
  const got = result.type === "float16" && result.data instanceof Uint16Array
    ? Array.from(result.data, half) : result.data;
  const expected = new Float64Array(await bytes(spec.expected.file));
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
  const line = `stage ${spec.stage}: rel_l2 ${rel.toExponential(3)} against the reference ` +
               `(tolerance ${spec.tolerance.toExponential(3)}): ${reproduced ? "reproduced" : "fixed"}`;
  return { reproduced, rel_l2: rel, tolerance: spec.tolerance, line };
}

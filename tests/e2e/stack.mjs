// The three services as real processes on loopback, for the JavaScript tests
// (the official `openai` SDK, the page in headless Chromium).
//
//   const stack = await startStack({ gateways: { open: [], keyed: ["--api_keys_file=..."] },
//                                    vision: ["--max_pixels_limit=1048576"] });
//   stack.http.open   // "http://127.0.0.1:PORT" of each gateway's HTTP front end
//   await stack.stop();
//
// Binaries, model and work folder come from the environment (set by ctest):
// VLM_VISION, VLM_LANGUAGE, VLM_GATEWAY, VLM_MODEL_DIR, VLM_WORK_DIR.
// Node modules (openai, puppeteer-core) are those scripts/setup.sh installs
// into $VLM_NODE_MODULES.
import { spawn, spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

export function env(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set (run through ctest)`);
  return value;
}

// require() of a package installed by scripts/setup.sh.
export function requireModule(name) {
  const dir = env("VLM_NODE_MODULES");
  if (!fs.existsSync(path.join(dir, name))) {
    throw new Error(`${name} is not installed in ${dir}: run scripts/setup.sh`);
  }
  return createRequire(path.join(dir, "..", "package.json"))(name);
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function waitForLine(file, regex, proc, timeoutMs) {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    const text = fs.existsSync(file) ? fs.readFileSync(file, "utf8") : "";
    const m = text.match(regex);
    if (m) return m;
    if (proc.exitCode !== null) throw new Error(`${file}: process exited ${proc.exitCode}`);
    await sleep(20);
  }
  throw new Error(`${file}: no ${regex} within ${timeoutMs} ms`);
}

export async function startStack({ gateways = { open: [] }, vision: visionFlags = [] } = {}) {
  const work = env("VLM_WORK_DIR");
  fs.mkdirSync(work, { recursive: true });
  const model = env("VLM_MODEL_DIR");
  const procs = [];
  const start = async (name, binary, flags) => {
    const out = path.join(work, `${name}.out`);
    const err = fs.openSync(path.join(work, `${name}.err`), "w");
    const outFd = fs.openSync(out, "w");
    const proc = spawn(binary, ["--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
      "--drain_timeout_s=2", ...flags], {
      stdio: ["ignore", outFd, err],
      env: { ...process.env, OMP_NUM_THREADS: "1", OMP_WAIT_POLICY: "passive" },
    });
    procs.push(proc);
    const m = await waitForLine(out, /vlm: listening grpc=(\S+) metrics=(\S+)/, proc, 60000);
    return { proc, out, grpc: m[1], metrics: `http://${m[2]}` };
  };
  const backend = [`--model_dir=${model}`, "--intra_op_threads=1"];
  const vision = await start("vision", env("VLM_VISION"), [...backend, ...visionFlags]);
  const language = await start("language", env("VLM_LANGUAGE"), [...backend, "--max_sequences=2"]);
  const http = {};
  const metrics = {};
  for (const [name, extra] of Object.entries(gateways)) {
    const g = await start(`gateway-${name}`, env("VLM_GATEWAY"), [
      "--http_address=127.0.0.1:0", `--model_dir=${model}`,
      `--language_target=${language.grpc}`, `--vision_targets=${vision.grpc}`, ...extra]);
    const m = await waitForLine(g.out, /vlm: http=(\S+)/, g.proc, 10000);
    http[name] = `http://${m[1]}`;
    metrics[name] = g.metrics;
  }
  // Ready when every gateway's /health says SERVING.
  const deadline = Date.now() + 60000;
  for (const url of Object.values(http)) {
    for (;;) {
      try {
        if ((await fetch(`${url}/health`)).status === 200) break;
      } catch (_) { /* not yet */ }
      if (Date.now() > deadline) throw new Error(`${url} not SERVING within 60 s`);
      await sleep(50);
    }
  }
  const stop = async () => {
    for (const p of procs.reverse()) {
      if (p.exitCode !== null) continue;
      p.kill("SIGTERM");
      const t = Date.now();
      while (p.exitCode === null && Date.now() - t < 20000) await sleep(20);
      if (p.exitCode === null) p.kill("SIGKILL");
    }
  };
  return { http, metrics, languageMetrics: language.metrics, model: path.basename(model), work, stop };
}

// A sample of a Prometheus text exposition, or 0 if absent.
export async function metric(metricsUrl, name) {
  const text = await (await fetch(`${metricsUrl}/metrics`)).text();
  const line = text.split("\n").find((l) => l.startsWith(name + " ") || l.startsWith(name + "{"));
  return line ? Number(line.slice(line.lastIndexOf(" ") + 1)) : 0;
}

// A deterministic RGB PNG (zlib from node; no image library needed).
export async function makePng(width, height, seed) {
  const zlib = await import("node:zlib");
  const rows = [];
  for (let y = 0; y < height; y++) {
    const row = Buffer.alloc(1 + width * 3);
    for (let x = 0; x < width; x++) {
      row[1 + x * 3] = (x * 7 + seed * 31) & 255;
      row[2 + x * 3] = (y * 5 + seed * 17) & 255;
      row[3 + x * 3] = ((x ^ y) * 3 + seed * 13) & 255;
    }
    rows.push(row);
  }
  const crcTable = Array.from({ length: 256 }, (_, n) => {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    return c >>> 0;
  });
  const crc = (buf) => {
    let c = 0xffffffff;
    for (const b of buf) c = crcTable[(c ^ b) & 255] ^ (c >>> 8);
    return (c ^ 0xffffffff) >>> 0;
  };
  const chunk = (type, data) => {
    const len = Buffer.alloc(4);
    len.writeUInt32BE(data.length);
    const body = Buffer.concat([Buffer.from(type), data]);
    const sum = Buffer.alloc(4);
    sum.writeUInt32BE(crc(body));
    return Buffer.concat([len, body, sum]);
  };
  const header = Buffer.alloc(13);
  header.writeUInt32BE(width, 0);
  header.writeUInt32BE(height, 4);
  header[8] = 8;   // bit depth
  header[9] = 2;   // RGB
  return Buffer.concat([
    Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]),
    chunk("IHDR", header),
    chunk("IDAT", zlib.deflateSync(Buffer.concat(rows))),
    chunk("IEND", Buffer.alloc(0)),
  ]);
}

// A JPEG of width x height made by Pillow (/usr/bin/python3, python3-pil from
// scripts/setup.sh): smooth gradients, so even 12000x9000 stays small.
export function makeJpeg(width, height, file) {
  const script = [
    "import sys",
    "from PIL import Image",
    "w, h = int(sys.argv[1]), int(sys.argv[2])",
    "g = Image.radial_gradient('L').resize((w, h))",
    "l = Image.linear_gradient('L').resize((w, h))",
    "Image.merge('RGB', (g, l, g.transpose(Image.FLIP_LEFT_RIGHT))).save(sys.argv[3], quality=85)",
  ].join("\n");
  const r = spawnSync("/usr/bin/python3", ["-c", script, String(width), String(height), file],
    { encoding: "utf8" });
  if (r.status !== 0) throw new Error(`Pillow could not write ${file}: ${r.stderr}`);
  return fs.readFileSync(file);
}

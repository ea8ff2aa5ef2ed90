// The gateway's web page in a real browser: Debian's Chromium, headless,
// driven by puppeteer-core. Uploads a large picture (prescaled in the page),
// asks, waits for the streamed answer and its stats line, asks a follow-up
// (the conversation goes back to the server), stops a long answer with the
// Stop button (the server frees the slot), and saves screenshots under the
// build tree. Fails if the page shows an error or an answer never arrives.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { startStack, requireModule, makePng, metric, env } from "../e2e/stack.mjs";

const puppeteer = requireModule("puppeteer-core");
let stack;
let browser;
let profile;

const KEY = "sk-page-test";

before(async () => {
  const work = env("VLM_WORK_DIR");
  fs.mkdirSync(work, { recursive: true });
  fs.writeFileSync(path.join(work, "api_keys"), `${KEY}\n`);
  stack = await startStack({
    gateways: { open: [], keyed: [`--api_keys_file=${path.join(work, "api_keys")}`] },
  });
  profile = fs.mkdtempSync(path.join(os.tmpdir(), "vlm-chromium-"));
  browser = await puppeteer.launch({
    executablePath: env("VLM_CHROMIUM"),
    headless: true,
    userDataDir: profile,
    // No sandbox (root in a container), no GPU, and nothing that phones home
    // (the machine has no network beyond loopback).
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage"],
  });
});

after(async () => {
  if (browser) await browser.close();
  if (stack) await stack.stop();
  if (profile) fs.rmSync(profile, { recursive: true, force: true });
});

async function noErrorShown(page) {
  const error = await page.$eval("#error", (e) => (e.hidden ? "" : e.textContent));
  assert.equal(error, "", `the page shows an error: ${error}`);
}

// Sends the question and waits until the answer has streamed in with its stats.
async function ask(page, question, answers) {
  await page.type("#prompt", question);
  await page.click("#send");
  await page.waitForFunction(
    (n) => document.querySelectorAll(".msg.assistant .stats").length >= n ||
      !document.getElementById("error").hidden,
    { timeout: 60000 }, answers);
  await noErrorShown(page);
  return page.$$eval(".msg.assistant", (all) => {
    const last = all[all.length - 1];
    return { answer: last.querySelector(".answer").textContent, stats: last.querySelector(".stats").textContent };
  });
}

test("upload, ask, follow up, stop; screenshots under the build tree", async () => {
  const shots = path.join(env("VLM_BINARY_DIR"), "tests", "browser");
  fs.mkdirSync(shots, { recursive: true });
  const picture = path.join(stack.work, "photo.png");
  fs.writeFileSync(picture, await makePng(1600, 1200, 5));

  const page = await browser.newPage();
  await page.setViewport({ width: 1000, height: 900 });
  const consoleErrors = [];
  page.on("pageerror", (e) => consoleErrors.push(String(e)));
  const requests = [];
  page.on("request", (r) => {
    if (r.url().endsWith("/v1/chat/completions")) requests.push(JSON.parse(r.postData()));
  });

  await page.goto(`${stack.http.open}/?max_side=512&max_tokens=12`, { waitUntil: "load" });
  await page.waitForFunction(() => document.getElementById("model").textContent.startsWith("model "));

  // Pick a 1600x1200 picture: the page scales it to 512 on its largest side.
  const input = await page.$("#file");
  await input.uploadFile(picture);
  await page.waitForSelector("#preview:not([hidden])");
  const info = await page.$eval("#preview-info", (e) => e.textContent);
  assert.equal(info, "1600×1200 → 512×384");

  const first = await ask(page, "What is in this picture?", 1);
  assert.ok(first.answer.length > 0, "empty answer");
  assert.match(first.stats, /prompt tokens \(\d+ for the image\)/);
  assert.match(first.stats, /12 answer tokens/);
  assert.match(first.stats, /image encoded|image from cache/);
  // What went over the wire is the prescaled picture.
  const sent = requests[0].messages[0].content[0].image_url.url;
  assert.match(sent, /^data:image\/jpeg;base64,/);
  const size = await page.evaluate((url) => new Promise((resolve) => {
    const img = new Image();
    img.onload = () => resolve([img.naturalWidth, img.naturalHeight]);
    img.src = url;
  }), sent);
  assert.deepEqual(size, [512, 384]);

  // The picture went with the question: the composer is empty again.
  assert.equal(await page.$eval("#preview", (e) => getComputedStyle(e).display), "none");
  const second = await ask(page, "And what colours does it have?", 2);
  assert.ok(second.answer.length > 0, "empty follow-up answer");
  assert.equal(requests.length, 2);
  assert.deepEqual(requests[1].messages.map((m) => m.role), ["user", "assistant", "user"]);
  assert.equal(requests[1].messages[1].content, first.answer);
  assert.equal(requests[1].stream, true);
  await page.screenshot({ path: path.join(shots, "page.png"), fullPage: true });

  // A long answer, stopped: the bubble says so, no error, and the server lets go.
  // The random model may end on its own (EOS) before Stop is pressed, so this
  // request carries the gateway's ignore_eos extension, added on the way out.
  await page.setRequestInterception(true);
  page.on("request", (r) => {
    if (r.isInterceptResolutionHandled()) return;
    if (r.url().endsWith("/v1/chat/completions") && r.method() === "POST") {
      r.continue({ postData: JSON.stringify({ ...JSON.parse(r.postData()), ignore_eos: true }) });
    } else {
      r.continue();
    }
  });
  // The tiny model streams hundreds of tokens a second: the answer is delivered to the
  // tab at a reading pace (as over a slow link), so Stop is pressed mid-answer however
  // busy the machine is.
  await page.emulateNetworkConditions({ download: 8 * 1024, upload: -1, latency: 0 });
  await page.$eval("#max-tokens", (e) => { e.value = "8000"; });
  await page.type("#prompt", "Tell me everything.");
  await page.click("#send");
  await page.waitForFunction(() => {
    const all = document.querySelectorAll(".msg.assistant .answer");
    return all.length === 3 && all[2].textContent.length > 40;
  }, { timeout: 60000, polling: 50 });  // not rAF: it stalls in a background tab
  await page.click("#stop");
  // Interval polling: requestAnimationFrame polling stalls in a starved headless tab.
  await page.waitForFunction(() => document.body.dataset.state === "idle",
    { timeout: 60000, polling: 100 });
  await page.emulateNetworkConditions(null);
  await page.screenshot({ path: path.join(shots, "page_stopped.png"), fullPage: true });
  await noErrorShown(page);
  assert.equal(await page.$$eval(".msg.assistant.stopped", (a) => a.length), 1);
  const deadline = Date.now() + 5000;
  while (await metric(stack.metrics.open, "vlm_gateway_admission_running") !== 0) {
    assert.ok(Date.now() < deadline, "stopping in the page did not cancel the generation");
    await new Promise((r) => setTimeout(r, 20));
  }
  assert.deepEqual(consoleErrors, []);
});

test("a server error is shown in plain words", async () => {
  const page = await browser.newPage();
  await page.goto(`${stack.http.open}/?max_tokens=5`, { waitUntil: "load" });
  await page.waitForFunction(() => document.getElementById("model").textContent.startsWith("model "));
  // A model name the server does not serve: 404 from the API.
  await page.evaluate("state.model = 'no-such-model'");
  await page.type("#prompt", "hi");
  await page.click("#send");
  await page.waitForSelector("#error:not([hidden])", { timeout: 30000 });
  const text = await page.$eval("#error", (e) => e.textContent);
  assert.match(text, /^Not found: the model "no-such-model" does not exist/);
  assert.equal(await page.$$eval(".msg.assistant", (a) => a.length), 0);
  assert.equal(await page.$eval("body", (b) => b.dataset.state), "error");
});

test("a dropped picture is taken like a picked one", async () => {
  const page = await browser.newPage();
  await page.goto(`${stack.http.open}/?max_side=64`, { waitUntil: "load" });
  const png = (await makePng(200, 100, 9)).toString("base64");
  await page.evaluate((b64) => {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const transfer = new DataTransfer();
    transfer.items.add(new File([bytes], "dropped.png", { type: "image/png" }));
    const drop = document.getElementById("drop");
    drop.dispatchEvent(new DragEvent("dragover", { dataTransfer: transfer, bubbles: true, cancelable: true }));
    drop.dispatchEvent(new DragEvent("drop", { dataTransfer: transfer, bubbles: true, cancelable: true }));
  }, png);
  await page.waitForSelector("#preview:not([hidden])");
  assert.equal(await page.$eval("#preview-info", (e) => e.textContent), "200×100 → 64×32");
  await noErrorShown(page);
});

test("with API keys the page asks for one, keeps it in the tab, and then works", async () => {
  const page = await browser.newPage();
  await page.goto(`${stack.http.keyed}/?max_tokens=3`, { waitUntil: "load" });
  await page.waitForSelector("#key-form:not([hidden])");
  assert.equal(await page.$eval("#model", (e) => e.textContent), "API key needed");
  await page.type("#key", KEY);
  await page.click("#key-form button[type=submit]");
  await page.waitForFunction(() => document.getElementById("model").textContent.startsWith("model "));
  assert.equal(await page.evaluate(() => sessionStorage.getItem("vlm.apiKey")), KEY);
  assert.equal(await page.$eval("#key-form", (e) => e.hidden), true);
  const { answer, stats } = await ask(page, "hello", 1);
  assert.ok(answer.length > 0);
  assert.match(stats, /3 answer tokens/);
});

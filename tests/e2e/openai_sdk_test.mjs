// The official `openai` JavaScript SDK against the gateway's HTTP front end on
// the tiny checkpoint: non-streaming, streaming with usage, an image as a data
// URL, logprobs, a pooled connection reused after 5.5 s idle, a bad parameter
// (BadRequestError, 400) and API keys (AuthenticationError, 401), and pictures
// of every size: a 12 MP phone photo with no options and with detail "low",
// 12000x9000, and the extreme shapes (1x1, 1x40000, 200:1, 201:1) that either
// answer or get a 400 naming the model's limit. Run by ctest with node's test
// runner.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { startStack, requireModule, makePng, makeJpeg, metric } from "./stack.mjs";

const OpenAI = requireModule("openai");
const KEY = "sk-sdk-test-key";
let stack;
let client;
const photos = {};  // made before the stack starts (Pillow takes seconds for 12000x9000)

before(async () => {
  const work = process.env.VLM_WORK_DIR;
  fs.mkdirSync(work, { recursive: true });
  const keys = path.join(work, "api_keys");
  fs.writeFileSync(keys, `${KEY}\n`);
  for (const [w, h] of [[4000, 3000], [12000, 9000]]) {
    photos[`${w}x${h}`] = makeJpeg(w, h, path.join(work, `photo_${w}x${h}.jpg`));
  }
  // A photo-sized limit above the tiny checkpoint's own 65536 pixels, so that
  // the default budget (0.5 MP) and detail "low" (512x512) differ.
  stack = await startStack({ gateways: { open: [], keyed: [`--api_keys_file=${keys}`] },
                             vision: ["--max_pixels_limit=1048576"] });
  client = new OpenAI({ baseURL: `${stack.http.open}/v1`, apiKey: "unused", maxRetries: 0, timeout: 60000 });
});

after(async () => {
  if (stack) await stack.stop();
});

test("models.list names the checkpoint", async () => {
  const models = [];
  for await (const m of client.models.list()) models.push(m.id);
  assert.deepEqual(models, [stack.model]);
});

// A client busy for a while between two calls (its event loop blocked, as by
// synchronous work) reuses its pooled connection without having seen a timer
// or the server's FIN: the connection must still be open. With a 5 s server
// keep-alive such a call failed with "Connection error." (maxRetries 0). Two
// gaps: one of them follows a response that does not end its connection.
test("a pooled connection idle for 5.5 s with the event loop blocked still serves", async () => {
  for (let gap = 0; gap < 2; ++gap) {
    const first = [];
    for await (const m of client.models.list()) first.push(m.id);
    execFileSync("sleep", ["5.5"]);
    const again = [];
    for await (const m of client.models.list()) again.push(m.id);
    assert.deepEqual(again, first, `after gap ${gap + 1}`);
  }
});

test("non-streaming completion", async () => {
  const c = await client.chat.completions.create({
    model: stack.model,
    messages: [{ role: "system", content: "Be brief." }, { role: "user", content: "Say hello." }],
    max_tokens: 5,
    temperature: 0,
  });
  assert.match(c.id, /^chatcmpl-/);
  assert.equal(c.object, "chat.completion");
  assert.equal(c.model, stack.model);
  assert.equal(c.choices.length, 1);
  assert.equal(c.choices[0].message.role, "assistant");
  assert.equal(typeof c.choices[0].message.content, "string");
  assert.equal(c.choices[0].finish_reason, "length");
  assert.equal(c.usage.completion_tokens, 5);
  assert.equal(c.usage.total_tokens, c.usage.prompt_tokens + 5);
  assert.equal(typeof c.usage.prompt_tokens_details.cached_tokens, "number");
});

test("streaming completion with include_usage equals the non-streaming answer", async () => {
  const request = {
    model: stack.model,
    messages: [{ role: "user", content: "Tell me about the sea." }],
    max_tokens: 6,
    temperature: 0,
  };
  const whole = await client.chat.completions.create(request);
  const stream = await client.chat.completions.create({
    ...request, stream: true, stream_options: { include_usage: true },
  });
  let text = "";
  let role = null;
  let finish = null;
  let usage = null;
  let chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    assert.equal(chunk.object, "chat.completion.chunk");
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices) {
      if (choice.delta.role) role = choice.delta.role;
      if (choice.delta.content) text += choice.delta.content;
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  }
  assert.ok(chunks >= 4, `${chunks} chunks`);
  assert.equal(role, "assistant");
  assert.equal(finish, "length");
  assert.equal(text, whole.choices[0].message.content);
  assert.equal(usage.completion_tokens, 6);
});

test("an image as a data URL", async () => {
  const png = await makePng(96, 64, 3);
  const c = await client.chat.completions.create({
    model: stack.model,
    messages: [{
      role: "user",
      content: [
        { type: "image_url", image_url: { url: `data:image/png;base64,${png.toString("base64")}`, detail: "auto" } },
        { type: "text", text: "What is in this picture?" },
      ],
    }],
    max_tokens: 4,
  });
  assert.equal(c.x_vlm.images.length, 1);
  assert.equal(c.x_vlm.images[0].tokens, 6);  // 96x64 -> 6 merged tokens
  assert.ok(c.usage.prompt_tokens > 6);
});

test("logprobs with top_logprobs", async () => {
  const c = await client.chat.completions.create({
    model: stack.model,
    messages: [{ role: "user", content: "Count." }],
    max_tokens: 3,
    temperature: 0,
    logprobs: true,
    top_logprobs: 2,
  });
  const content = c.choices[0].logprobs.content;
  assert.equal(content.length, 3);
  for (const t of content) {
    assert.ok(t.logprob <= 0);
    assert.equal(t.top_logprobs.length, 2);
    assert.deepEqual(t.bytes, [...Buffer.from(t.token, "utf8")]);
  }
  assert.equal(content.map((t) => t.token).join(""), c.choices[0].message.content);
});

test("a bad parameter raises BadRequestError (400) naming it", async () => {
  await assert.rejects(
    client.chat.completions.create({
      model: stack.model, messages: [{ role: "user", content: "hi" }], top_p: 7,
    }),
    (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, e.constructor.name);
      assert.equal(e.status, 400);
      assert.equal(e.param, "top_p");
      assert.equal(e.type, "invalid_request_error");
      return true;
    });
  // And the server keeps serving.
  const ok = await client.chat.completions.create({
    model: stack.model, messages: [{ role: "user", content: "hi" }], max_tokens: 1,
  });
  assert.equal(ok.usage.completion_tokens, 1);
});

test("a wrong API key raises AuthenticationError (401); the right one works", async () => {
  const wrong = new OpenAI({ baseURL: `${stack.http.keyed}/v1`, apiKey: "sk-wrong", maxRetries: 0 });
  await assert.rejects(
    wrong.chat.completions.create({ model: stack.model, messages: [{ role: "user", content: "hi" }] }),
    (e) => {
      assert.ok(e instanceof OpenAI.AuthenticationError, e.constructor.name);
      assert.equal(e.status, 401);
      return true;
    });
  const right = new OpenAI({ baseURL: `${stack.http.keyed}/v1`, apiKey: KEY, maxRetries: 0 });
  const c = await right.chat.completions.create({
    model: stack.model, messages: [{ role: "user", content: "hi" }], max_tokens: 2,
  });
  assert.equal(c.usage.completion_tokens, 2);
});

test("aborting a stream through the SDK frees the admission slot", async () => {
  const controller = new AbortController();
  const stream = await client.chat.completions.create({
    model: stack.model, messages: [{ role: "user", content: "A long story." }],
    max_tokens: 8192, ignore_eos: true, stream: true,
  }, { signal: controller.signal });
  // 8192 tokens take the tiny model well over 5 s: only a cancellation ends it in time.
  let n = 0;
  try {
    for await (const _ of stream) {
      if (++n === 20) controller.abort();
    }
  } catch (e) {
    assert.equal(e.name, "APIUserAbortError", String(e));
  }
  assert.ok(n >= 20, `${n} chunks before the abort`);
  const deadline = Date.now() + 5000;
  while (await metric(stack.metrics.open, "vlm_gateway_admission_running") !== 0) {
    assert.ok(Date.now() < deadline, "the generation was not cancelled within 5 s");
    await new Promise((r) => setTimeout(r, 20));
  }
});

function imageRequest(bytes, mime, detail) {
  const image_url = { url: `data:${mime};base64,${bytes.toString("base64")}` };
  if (detail !== undefined) image_url.detail = detail;
  return {
    model: stack.model,
    messages: [{ role: "user", content: [
      { type: "image_url", image_url },
      { type: "text", text: "What is in this picture?" },
    ] }],
    max_tokens: 2,
  };
}

test("a 12 MP phone photo with no options answers, resized; detail low is smaller", async () => {
  const jpeg = photos["4000x3000"];
  const plain = await client.chat.completions.create(imageRequest(jpeg, "image/jpeg"));
  const image = plain.x_vlm.images[0];
  // smart_resize(3000, 4000, 32, 65536, 524288): beta = sqrt(12e6 / 524288) = 4.784,
  // floor(3000 / 4.784 / 32) * 32 = 608, floor(4000 / 4.784 / 32) * 32 = 832:
  // 38 x 52 patches, 494 tokens.
  assert.deepEqual(image.grid, [1, 38, 52]);
  assert.equal(image.max_pixels, 524288);
  assert.equal(image.tokens, 494);
  assert.ok(plain.usage.prompt_tokens > 494);
  const low = await client.chat.completions.create(imageRequest(jpeg, "image/jpeg", "low"));
  const small = low.x_vlm.images[0];
  assert.equal(small.max_pixels, 262144);
  assert.deepEqual(small.grid, [1, 26, 36]);  // 416 x 576
  assert.ok(small.tokens < image.tokens);
  assert.equal(low.usage.prompt_tokens - plain.usage.prompt_tokens, small.tokens - image.tokens);
});

test("12000x9000 answers at the default budget", async () => {
  const jpeg = photos["12000x9000"];
  const c = await client.chat.completions.create(imageRequest(jpeg, "image/jpeg"));
  const image = c.x_vlm.images[0];
  assert.deepEqual(image.grid, [1, 38, 52]);  // 4:3 like the 12 MP photo: 608 x 832
  assert.equal(image.max_pixels, 524288);
});

test("extreme shapes answer or get a 400 naming the model's limit", async () => {
  const cases = [
    // [width, height, null = answers | the words the 400 must name]
    [400, 2, null],                      // 200:1, the largest ratio served
    [2, 400, null],
    [402, 2, "maximum aspect ratio is 200"],  // 201:1
    [1, 40000, "maximum aspect ratio is 200"],
    [1, 1, "min_image_side"],
  ];
  for (const [w, h, refusal] of cases) {
    const png = await makePng(w, h, w + h);
    const request = client.chat.completions.create(imageRequest(png, "image/png"));
    if (refusal === null) {
      const c = await request;
      const image = c.x_vlm.images[0];
      assert.ok(image.tokens > 0, `${w}x${h}`);
      assert.equal(image.grid[1] > image.grid[2], h > w, `${w}x${h}: ${image.grid}`);
      continue;
    }
    await assert.rejects(request, (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, `${w}x${h}: ${e.constructor.name}`);
      assert.equal(e.status, 400);
      assert.ok(e.message.includes(refusal), `${w}x${h}: ${e.message}`);
      assert.ok(!/max_message_mb|max_pixels_limit|too large/.test(e.message), e.message);
      return true;
    });
  }
});

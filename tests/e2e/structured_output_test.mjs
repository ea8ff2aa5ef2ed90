// Structured output through the official `openai` JavaScript SDK on the tiny
// random-weight checkpoint: whatever the model prefers, a response_format
// json_schema answer parses and validates against the schema with ajv (an
// independent validator), plain and streamed, and ends with finish_reason
// "stop"; JSON mode parses; tools with tool_choice "required" and a named
// function give valid tool_calls (finish_reason "tool_calls"), also streamed;
// a bad schema is a 400 naming response_format. Run by ctest with node's test
// runner.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";
import { startStack, requireModule } from "./stack.mjs";

const OpenAI = requireModule("openai");
const Ajv = requireModule("ajv");
let stack;
let client;
// The formats the schemas below use, as the grammar defines them (RFC 3339
// full-date; RFC 4122's textual form).
const ajv = new (Ajv.default || Ajv)({ strict: true, allErrors: true });
ajv.addFormat("date", /^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$/);
ajv.addFormat("uuid", /^[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$/);

before(async () => {
  fs.mkdirSync(process.env.VLM_WORK_DIR, { recursive: true });
  stack = await startStack({ gateways: { open: [] } });
  client = new OpenAI({ baseURL: `${stack.http.open}/v1`, apiKey: "unused", maxRetries: 0, timeout: 120000 });
});

after(async () => {
  if (stack) await stack.stop();
});

// Strings, arrays and numbers bounded, so that a random model ends within
// max_tokens: the grammar decides the length, not the model.
const str = (maxLength, extra = {}) => ({ type: "string", maxLength, ...extra });
const SCHEMAS = {
  invoice: {
    type: "object",
    properties: {
      number: str(10),
      total: { type: "number", minimum: 0, maximum: 100000 },
      currency: { enum: ["EUR", "USD", "GBP"] },
      paid: { type: "boolean" },
    },
    required: ["number", "total", "currency", "paid"],
    additionalProperties: false,
  },
  shelf: {
    type: "object",
    properties: {
      items: {
        type: "array",
        items: {
          type: "object",
          properties: { sku: str(8), count: { type: "integer", minimum: 0, maximum: 99 } },
          required: ["sku", "count"],
        },
        minItems: 1,
        maxItems: 3,
      },
    },
    required: ["items"],
  },
  enumOnly: { enum: ["cat", "dog", 3, null, true] },
  constValue: { type: "object", properties: { kind: { const: "receipt" }, id: { type: "integer", minimum: 1, maximum: 9 } }, required: ["kind", "id"] },
  nullable: { type: "object", properties: { note: { type: ["string", "null"], maxLength: 6 } }, required: ["note"] },
  anyOf: {
    anyOf: [
      { type: "object", properties: { ok: { const: true } }, required: ["ok"] },
      { type: "object", properties: { error: str(10) }, required: ["error"] },
    ],
  },
  optionalFields: {
    type: "object",
    properties: { a: { type: "integer", minimum: -5, maximum: 5 }, b: str(4), c: { type: "boolean" } },
    required: ["a"],
    additionalProperties: false,
  },
  refs: {
    $defs: { point: { type: "object", properties: { x: { type: "integer", minimum: 0, maximum: 9 }, y: { type: "integer", minimum: 0, maximum: 9 } }, required: ["x", "y"] } },
    type: "object",
    properties: { from: { $ref: "#/$defs/point" }, to: { $ref: "#/$defs/point" } },
    required: ["from", "to"],
  },
  stringLengths: { type: "array", items: str(5, { minLength: 2 }), minItems: 2, maxItems: 2 },
  formats: { type: "object", properties: { day: { type: "string", format: "date" }, id: { type: "string", format: "uuid" } }, required: ["day", "id"] },
  pattern: { type: "object", properties: { code: { type: "string", pattern: "^[A-Z]{3}-[0-9]{2}$" } }, required: ["code"] },
  nested: {
    type: "object",
    properties: { meta: { type: "object", properties: { tags: { type: "array", items: { enum: ["x", "y"] }, maxItems: 2 }, level: { type: "integer", minimum: 1, maximum: 3 } }, required: ["tags", "level"] } },
    required: ["meta"],
  },
};

function request(name, schema, seed) {
  return {
    model: stack.model,
    messages: [{ role: "user", content: `Answer as JSON (${name}).` }],
    response_format: { type: "json_schema", json_schema: { name, schema, strict: true } },
    max_tokens: 400,
    temperature: 0.8,
    seed,
  };
}

function checkAnswer(name, schema, text) {
  let value;
  assert.doesNotThrow(() => { value = JSON.parse(text); }, `${name}: not JSON: ${text}`);
  const validate = ajv.compile(schema);
  assert.ok(validate(value), `${name}: ${text} fails the schema: ${ajv.errorsText(validate.errors)}`);
}

for (const [name, schema] of Object.entries(SCHEMAS)) {
  test(`json_schema ${name}: plain and streamed answers validate`, async () => {
    const c = await client.chat.completions.create(request(name, schema, 1));
    assert.equal(c.choices[0].finish_reason, "stop", c.choices[0].message.content);
    checkAnswer(name, schema, c.choices[0].message.content);

    const stream = await client.chat.completions.create({ ...request(name, schema, 2), stream: true });
    let text = "";
    let finish = null;
    for await (const chunk of stream) {
      for (const choice of chunk.choices) {
        if (choice.delta.content) text += choice.delta.content;
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    assert.equal(finish, "stop", text);
    checkAnswer(name, schema, text);
  });
}

test("n = 3 gives three indexed choices, each valid, plain and streamed", async () => {
  const schema = SCHEMAS.pattern;
  const c = await client.chat.completions.create({ ...request("pattern", schema, 7), n: 3 });
  assert.deepEqual(c.choices.map((x) => x.index), [0, 1, 2]);
  for (const choice of c.choices) {
    assert.equal(choice.finish_reason, "stop", choice.message.content);
    checkAnswer("pattern", schema, choice.message.content);
  }
  // Prompt counted once, completions summed (each choice's own usage in x_vlm).
  const own = c.x_vlm.choice_usage;
  assert.equal(own.length, 3);
  assert.equal(c.usage.prompt_tokens, own[0].prompt_tokens);
  assert.equal(c.usage.completion_tokens, own.reduce((sum, u) => sum + u.completion_tokens, 0));

  const stream = await client.chat.completions.create({
    ...request("pattern", schema, 7), n: 3, stream: true, stream_options: { include_usage: true },
  });
  const texts = ["", "", ""];
  const finishes = [null, null, null];
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices) {
      if (choice.delta.content) texts[choice.index] += choice.delta.content;
      if (choice.finish_reason) finishes[choice.index] = choice.finish_reason;
    }
  }
  assert.deepEqual(finishes, ["stop", "stop", "stop"]);
  // Same seed: the streamed choices are the plain ones.
  assert.deepEqual(texts, c.choices.map((x) => x.message.content));
  assert.equal(usage.completion_tokens, c.usage.completion_tokens);

  await assert.rejects(
    client.chat.completions.create({ ...request("pattern", schema, 7), n: 9 }),
    (e) => e.status === 400 && e.param === "n");
});

test("json_object mode answers parse as objects", async () => {
  for (const seed of [1, 2, 3]) {
    const c = await client.chat.completions.create({
      model: stack.model,
      messages: [{ role: "user", content: "Reply in JSON." }],
      response_format: { type: "json_object" },
      max_tokens: 200,
      temperature: 0.8,
      seed,
    });
    const text = c.choices[0].message.content;
    assert.equal(c.choices[0].finish_reason, "stop", text);
    const value = JSON.parse(text);
    assert.equal(typeof value, "object");
    assert.ok(value !== null && !Array.isArray(value), text);
  }
});

const TOOLS = [
  {
    type: "function",
    function: {
      name: "lookup_sku",
      description: "Find a product by its SKU",
      parameters: { type: "object", properties: { sku: str(8), qty: { type: "integer", minimum: 1, maximum: 9 } }, required: ["sku", "qty"] },
    },
  },
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "Weather in a city",
      parameters: { type: "object", properties: { city: str(10), unit: { enum: ["c", "f"] } }, required: ["city", "unit"] },
    },
  },
];

function checkCall(call, names) {
  assert.match(call.id, /^call_/);
  assert.equal(call.type, "function");
  assert.ok(names.includes(call.function.name), call.function.name);
  assert.equal(typeof call.function.arguments, "string");
  const tool = TOOLS.find((t) => t.function.name === call.function.name);
  checkAnswer(call.function.name, tool.function.parameters, call.function.arguments);
}

test("tools with tool_choice required and a named function give valid tool_calls", async () => {
  const base = {
    model: stack.model,
    messages: [{ role: "user", content: "How many of SKU AB-12 are left?" }],
    tools: TOOLS,
    max_tokens: 300,
    temperature: 0.8,
  };
  for (const seed of [1, 2]) {
    const c = await client.chat.completions.create({ ...base, tool_choice: "required", seed });
    const choice = c.choices[0];
    assert.equal(choice.finish_reason, "tool_calls", JSON.stringify(choice.message));
    assert.equal(choice.message.tool_calls.length, 1);
    checkCall(choice.message.tool_calls[0], ["lookup_sku", "get_weather"]);
  }
  const named = await client.chat.completions.create({
    ...base, tool_choice: { type: "function", function: { name: "get_weather" } }, seed: 3,
  });
  assert.equal(named.choices[0].finish_reason, "tool_calls");
  assert.equal(named.choices[0].message.tool_calls[0].function.name, "get_weather");
  checkCall(named.choices[0].message.tool_calls[0], ["get_weather"]);

  // Streamed: the SDK's accumulator rebuilds the same kind of call.
  const stream = client.chat.completions.stream({
    ...base, tool_choice: { type: "function", function: { name: "lookup_sku" } }, seed: 4,
  });
  const final = await stream.finalChatCompletion();
  assert.equal(final.choices[0].finish_reason, "tool_calls");
  assert.equal(final.choices[0].message.tool_calls.length, 1);
  checkCall(final.choices[0].message.tool_calls[0], ["lookup_sku"]);

  // The call and its result go back into the history (Qwen3's tool format).
  const call = named.choices[0].message.tool_calls[0];
  const followUp = await client.chat.completions.create({
    ...base,
    messages: [...base.messages, { role: "assistant", content: null, tool_calls: [call] },
      { role: "tool", tool_call_id: call.id, content: "18 C and sunny" }],
    tool_choice: "none",
    max_tokens: 4,
  });
  assert.equal(typeof followUp.choices[0].message.content, "string");
  assert.equal(followUp.choices[0].message.tool_calls, undefined);
});

test("a bad schema, a bad tool and a too short max_tokens are 400s naming the parameter", async () => {
  const bad = async (body, param, pattern) => {
    await assert.rejects(
      client.chat.completions.create({ model: stack.model, messages: [{ role: "user", content: "hi" }], ...body }),
      (e) => {
        assert.ok(e instanceof OpenAI.BadRequestError, `${e}`);
        assert.equal(e.status, 400);
        assert.equal(e.param, param, e.message);
        assert.match(e.message, pattern);
        return true;
      });
  };
  await bad({ response_format: { type: "json_schema", json_schema: { name: "x", schema: { type: "object", not: {} } } } },
    "response_format", /not/);
  await bad({ response_format: { type: "json_schema", json_schema: { name: "x", schema: { type: "strnig" } } } },
    "response_format", /strnig/);
  await bad({ response_format: { type: "json_schema", json_schema: { name: "x", schema: { type: "object", properties: { a_long_property_name: { type: "string" } }, required: ["a_long_property_name"] } } }, max_tokens: 5 },
    "response_format", /max_tokens/);
  await bad({ tools: [{ type: "function", function: { name: "f", parameters: { type: "object", properties: { a: { type: "nope" } } } } }], tool_choice: "required" },
    "tools[0].parameters", /nope/);
  await bad({ tools: TOOLS, tool_choice: { type: "function", function: { name: "missing" } } },
    "tool_choice", /missing/);
});

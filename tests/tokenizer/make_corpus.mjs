// Writes tests/tokenizer/corpus.json: the strings and id sequences whose
// encodings/decodings the JS oracle pins (golden_ids.mjs). Hand-written cases
// per category, plus cases generated from a fixed seed so the file is
// reproducible byte for byte:
//   node tests/tokenizer/make_corpus.mjs            rewrite corpus.json
//   node tests/tokenizer/make_corpus.mjs --check    fail if corpus.json differs
import { readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const corpusPath = join(here, "corpus.json");

// mulberry32: a tiny deterministic PRNG.
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const cases = []; // {category, text}
const add = (category, ...texts) => {
  for (const text of texts) cases.push({ category, text });
};

// --- hand-written --------------------------------------------------------
add("spec", "Hello", " Hello world", "You are a helpful assistant.", "I'll pay $1,234.50",
  "Hello world! 12345  ok\n\n", "user", "assistant", "system", "\n",
  // Rendered chat examples a)-d) of section 7.2.
  "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n<|im_start|>assistant\n",
  "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n<|im_start|>assistant\n",
  "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n<|im_start|>user\nWhat color?<|im_end|>\n<|im_start|>assistant\n",
  "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>Compare.<|im_end|>\n<|im_start|>assistant\n",
  "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: <|vision_start|><|image_pad|><|vision_end|>Compare.<|im_end|>\n<|im_start|>assistant\n");

add("prose",
  "The quick brown fox jumps over the lazy dog.",
  "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.",
  "Call me Ishmael. Some years ago - never mind how long precisely - having little or no money in my purse...",
  "\"Quoted,\" she said; (parenthetical) [bracketed] {braced} <angled>.",
  "e.g. i.e. etc. Mr. Smith vs. Dr. Jones -- an em—dash and an en–dash…",
  "ALL CAPS SENTENCE WITH NUMBERS 42 AND SYMBOLS #@!",
  "mIxEd CaSe wOrDs ArE fUn",
  "Hyphenated-words and under_scored_words and CamelCaseWords.",
  "A sentence ending with a question?! And an interrobang‽",
  "Email me at someone@example.com or visit https://example.org/path?q=1&r=two#frag.",
  "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et dolore magna aliqua.",
  "Ünïcödé äccents in Gërman: Straße, Größe, Übermut, Ökonomie.",
  "Français: où est la bibliothèque ? Ça va très bien, merci !",
  "Español: ¿Dónde está el baño? ¡Qué sorpresa!",
  "Português: não, ação, coração, maçã.",
  "Polski: zażółć gęślą jaźń.",
  "Türkçe: İstanbul, ığdır, şişli, çağ.",
  "Tiếng Việt: Xin chào, tôi là người Việt Nam.",
  "Ελληνικά: Καλημέρα κόσμε, ΑΒΓΔ αβγδ.",
  "Русский: Съешь же ещё этих мягких французских булок, да выпей чаю.",
  "Українська: Ґанок, їжак, є.",
  "a", "I", " ", "  ", "x y", ".", "!!", "?", "'", "\"", "-", "_", "a.b", "1", "a1", "1a");

add("code",
  "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
  "int main(int argc, char** argv) {\n\tstd::cout << \"hi\" << std::endl;\n\treturn 0;\n}\n",
  "for (let i = 0; i < arr.length; ++i) { sum += arr[i] ** 2; }",
  "const x = a?.b ?? c; // optional chaining && nullish || fallback",
  "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%bob%';",
  "{\"key\": [1, 2.5, -3e10, true, null], \"nested\": {\"a\": \"b\"}}",
  "#include <vector>\n#define MAX(a,b) ((a)>(b)?(a):(b))\n",
  "    indented with spaces\n\tindented with a tab\n        \n",
  "x+=1;y-=2;z*=3;w/=4;v%=5;u<<=6;t>>=7;",
  "if (a != b && c == d || !e) { return; }",
  "echo \"$HOME\" | grep -v '^#' > /dev/null 2>&1 && ls -la ~/",
  "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
  "<div class=\"container\"><p id='x'>Hello &amp; welcome</p></div>",
  "<html><body><!-- comment --></body></html>",
  "lambda x: x**2 if x>0 else -x  # ternary",
  "public static void Main(string[] args) => Console.WriteLine(\"C#\");",
  "$ git commit -m \"fix: handle CRLF\"\r\n",
  "a_b_c __init__ __dunder__ ___triple___",
  "regex = r'^(?:[a-z0-9!#$%&*+/=?^_`{|}~-]+)$'",
  "0x1F 0b1010 0o777 1_000_000 3.14159 6.02e23 1e-9",
  "x=[i for i in range(10)if i%2==0]",
  "  return   ;   ",
  "\t\t\tdeep tabs",
  "}}}}]]]]))))",
  "////////////////////////////////////////",
  "================================================================",
  "-------------------------------------\n",
  "**bold** _italic_ `code` ~~strike~~ > quote\n- item\n1. item\n");

add("numbers",
  "1234567890", "3.14159265358979", "-42", "+1 (555) 123-4567", "2024-01-31T23:59:59Z",
  "$0.99", "€1.234,56", "£100", "¥5000", "₹2,50,000", "₿0.0001", "100%", "50°C", "1/2 ¾ ½",
  "10,000,000", "1.2.3.4", "v1.2.3-beta.4", "12:30pm", "No. 7", "#1", "1st 2nd 3rd 4th",
  "٠١٢٣٤٥٦٧٨٩", "०१२३४५६७८९", "一二三四五", "①②③", "ⅠⅡⅢⅣ", "¹²³", "１２３４５",
  "1e100", "0.000001", "999999999999999999999");

add("whitespace",
  "trailing spaces   ", "   leading spaces", "a  b   c    d", "tab\tseparated\tvalues",
  "windows\r\nline\r\nendings\r\n", "mac\rold\rstyle", "unix\nnewlines\n", "\n\n\n", "\r\n\r\n",
  " \n \n ", "\t\n\t\n", "end with newline and space\n ", "a \n b", "word\n\n\nword",
  "   \n   x", "x   \n", "\n   ", "     ", "\t", "\t\t", " \t \t ", "a\u00a0b", "a\u00a0\u00a0b",
  "a\u3000b", "a\u2028b\u2029c", "a\u0085b", "\ufeffBOM at start", "a\u200bb zero width",
  "a\u2003b em space", "x\u000by\u000cz", "\r", "a\r\n\r\n\r\nb", "  \r\n  ",
  "line one  \nline two\t\nline three \r\n");

add("contractions",
  "I'm you're he's she'd we'll they've it's", "I'M YOU'RE HE'S SHE'D WE'LL THEY'VE IT'S",
  "don't can't won't shouldn't", "DON'T CAN'T WON'T SHOULDN'T", "We'Re We'rE wE'Ll I'D i'd",
  "'s 't 're 've 'm 'll 'd", "'S 'T 'RE 'VE 'M 'LL 'D", "''s ''", "rock 'n' roll", "'tis 'twas",
  "O'Brien o'clock", "it’s curly apostrophe", "the dogs' bones", "'", "''", "'ss", "'llama",
  "I'ſ", "x's's's");

add("cjk",
  "你好，世界！", "我爱自然语言处理。", "今天天气很好，我们去公园散步吧。",
  "机器学习是人工智能的一个分支，它使计算机能够从数据中学习。",
  "繁體中文：這是一個測試。", "日本語のテキスト：こんにちは、世界。", "カタカナとひらがなと漢字",
  "한국어: 안녕하세요, 세계!", "中文English混合mixed文本", "价格是¥1,299元", "“引号”和「括号」",
  "第1章 第2节", "　全角空格　", "ＡＢＣ全角英文", "𠀀𠀁𠀂 CJK Extension B", "〇一二三");

add("scripts",
  "العربية: مرحبا بالعالم", "السلام عليكم ورحمة الله", "عربي123عربي", "עברית: שלום עולם",
  "हिन्दी: नमस्ते दुनिया", "क्षत्रिय ज्ञान श्री", "தமிழ்: வணக்கம்", "বাংলা: হ্যালো",
  "ไทย: สวัสดีชาวโลก", "ქართული: გამარჯობა", "Հայերեն: Բարեւ", "አማርኛ: ሰላም", "ᚠᚢᚦᚨᚱᚲ runes",
  "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math fraktur", "𝐁𝐨𝐥𝐝 𝑰𝒕𝒂𝒍𝒊𝒄", "Ωmega ∑ ∫ √ ∞ ≠ ≤ ≥", "→ ← ↑ ↓ ⇒ ⇔");

add("emoji",
  "😀", "Hello 😀 world", "👍🏻👍🏼👍🏽👍🏾👍🏿", "👨‍👩‍👧‍👦 family", "🏳️‍🌈 flag", "🇺🇸🇯🇵🇫🇷",
  "1️⃣ 2️⃣ #️⃣", "❤️ ♥ ❤", "🧑🏽‍💻 coder", "👩🏿‍🦱", "🤷‍♀️🤷‍♂️", "emoji😀without😀spaces",
  "🔥🔥🔥🔥🔥", "☕ and 🍵", "🫠🫡🫶");

add("nfc",
  "e\u0301", "cafe\u0301", "A\u030a", "\u212b ångström sign", "\u212a kelvin sign", "o\u0308\u0304",
  "\u1100\u1161\u11a8 jamo", "\u1112\u1161\u11ab\u1100\u1173\u11af", "n\u0303o", "a\u0300\u0301\u0302",
  "\u0065\u0327\u0301", "\u0041\u0301\u0328", "s\u0323\u0307", "\u00c5 vs A\u030a",
  "\u1e9b\u0323", "\u0958 devanagari qa (composition exclusion)", "\u2126 ohm sign",
  "\u0344 combining greek", "x\u0301\u0301\u0301\u0301", "\u0301 leading combining mark",
  "I\u0307stanbul", "\u03d3 \u03d2\u0301", "\uff76\uff9e halfwidth");

add("special",
  "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
  "text<|endoftext|>more text", "<|im_start|><|im_end|><|endoftext|>", "a<|im_end|>b<|im_end|>c",
  "<think>reasoning</think>answer", "<tool_call>{\"name\": \"f\"}</tool_call>",
  "<tool_response>ok</tool_response>", "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
  "<|repo_name|>repo<|file_sep|>a.py", "<|object_ref_start|>cat<|object_ref_end|><|box_start|>(1,2),(3,4)<|box_end|>",
  "<|quad_start|><|quad_end|><|vision_pad|><|video_pad|>", " <|im_end|> ", "\n<|im_start|>\n",
  "<|im_end|>\u0301 combining after special", "é<|endoftext|>\u0301", "<|fim_pad|><|fim_pad|>",
  "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>");

add("lookalike",
  "<|im_start|", "|im_start|>", "<|im_start >", "< |im_start|>", "<|IM_START|>", "<|im-start|>",
  "<|im_start|x", "<|endoftext", "endoftext|>", "<think", "think>", "</think", "<Think>",
  "<|im_start||>", "<<|im_end|>>", "<|<|im_end|>|>", "<|unknown_token|>", "<|>", "<||>",
  "<tool_call", "<tool_calls>", "<|im_start|>x<|im_end", "&lt;|im_start|&gt;", "<\u200b|im_start|>");

// Long words: letters, digits, symbols, no spaces.
add("long",
  "a".repeat(1000), "ab".repeat(700), "Supercalifragilisticexpialidocious".repeat(20),
  "Donaudampfschifffahrtselektrizitätenhauptbetriebswerkbauunterbeamtengesellschaft",
  "pneumonoultramicroscopicsilicovolcanoconiosis", "1".repeat(300), "!".repeat(500),
  "-".repeat(257), " ".repeat(300), "\n".repeat(200), "字".repeat(400), "😀".repeat(100),
  "ĠĠĠĠ Ġ ĊĊ", "x".repeat(255), "y".repeat(256), "z".repeat(257),
  "aGVsbG8gd29ybGQgdGhpcyBpcyBiYXNlNjQgZW5jb2RlZCB0ZXh0IGZvciB0ZXN0aW5nIHB1cnBvc2Vz",
  "https://www.example.com/a/very/long/path/with/many/segments/and?query=parameters&that=go&on=and&on");

// --- generated -------------------------------------------------------------
const rand = rng(20240531);
const pick = (xs) => xs[Math.floor(rand() * xs.length)];
const words = ["the", "of", "and", "to", "in", "is", "model", "token", "Vision", "LANGUAGE",
  "image", "cat", "dog", "running", "tokenizer", "BPE", "merges", "isn't", "we'll", "O'Neil",
  "naïve", "résumé", "Zürich", "東京", "北京大学", "한국", "مرحبا", "नमस्ते", "Москва", "😀", "👍🏽",
  "3.14", "$20", "100%", "x_1", "foo()", "a->b", "i++", "#tag", "@user", "e\u0301", "\u212b",
  "<|im_end|>", "<think>", "<|im_start", "\t", "\r\n", "\n\n", "  ", "\u00a0", "\u3000"];
const seps = [" ", " ", " ", "  ", "\n", "\t", "", ", ", ". ", "! ", "\r\n", " \n", "   "];
for (let i = 0; i < 170; ++i) {
  const n = 1 + Math.floor(rand() * 25);
  let s = "";
  for (let k = 0; k < n; ++k) s += pick(words) + pick(seps);
  add("generated", s);
}

// Random code points from assorted blocks (assigned in Unicode 15.0, so the
// C++ side's ICU 72 and node's newer ICU agree on their categories).
const blocks = [[0x20, 0x7e], [0xa0, 0x17f], [0x300, 0x36f], [0x370, 0x3ff], [0x400, 0x4ff],
  [0x5d0, 0x5ea], [0x620, 0x64a], [0x905, 0x939], [0xe01, 0xe3a], [0x3041, 0x3096],
  [0x4e00, 0x9fa5], [0xac00, 0xd7a3], [0x1f600, 0x1f64f], [0x2000, 0x206f], [0xff01, 0xff5e]];
for (let i = 0; i < 40; ++i) {
  const n = 1 + Math.floor(rand() * 40);
  let s = "";
  for (let k = 0; k < n; ++k) {
    const [lo, hi] = pick(blocks);
    const cp = lo + Math.floor(rand() * (hi - lo + 1));
    if (cp >= 0x2060 && cp <= 0x206f) continue; // unassigned/format gaps in that block
    s += String.fromCodePoint(cp);
  }
  add("random_codepoints", s);
}

// About 10 kB of mixed text, several times.
const paragraphs = [
  "The tokenizer splits text into pieces, maps bytes to symbols and merges them by rank. ",
  "分词器把文本切成片段，把字节映射成符号，再按照合并顺序合并。",
  "for (size_t i = 0; i < n; ++i) {\n  out[i] = in[i] * 2;\n}\n",
  "Numbers like 1,234,567.89 and dates like 2025-06-01 appear often.\r\n",
  "Émojis 😀👍🏽 and accents naïve café are common in chat.\n\n",
  "    def method(self, x):\n        return x  # comment\n",
];
for (let i = 0; i < 5; ++i) {
  let s = "";
  while (Buffer.byteLength(s, "utf8") < 10240) s += pick(paragraphs) + pick(seps);
  add("10kB", s);
}

// --- id sequences for decoding ---------------------------------------------
// Single bytes (ids 0..255 are the 256 byte tokens), ordinary merged tokens,
// and added tokens, so that decoding meets split and ill-formed UTF-8, special
// tokens (skipped or not) and non-special added tokens.
const decode = [
  [9707, 1879], [151644, 872, 198, 9707, 151645], [151667, 9707, 151668],
  [126, 227], [126], [227], [126, 151645, 227], [126, 151643, 227], [151645, 151643],
];
for (let i = 0; i < 100; ++i) {
  const n = 1 + Math.floor(rand() * 30);
  const ids = [];
  for (let k = 0; k < n; ++k) {
    const r = rand();
    if (r < 0.5) ids.push(Math.floor(rand() * 256));
    else if (r < 0.85) ids.push(256 + Math.floor(rand() * (151643 - 256)));
    else ids.push(151643 + Math.floor(rand() * 26));
  }
  decode.push(ids);
}

// --- output: one case per line for readable diffs ---------------------------
const lines = cases.map((c) => "  " + JSON.stringify(c));
const text =
  "{\"encode\": [\n" + lines.join(",\n") + "\n],\n\"decode\": [\n" +
  decode.map((d) => "  " + JSON.stringify(d)).join(",\n") + "\n]}\n";

if (process.argv.includes("--check")) {
  const old = readFileSync(corpusPath, "utf8");
  if (old !== text) {
    console.error("corpus.json differs from make_corpus.mjs output; rerun node tests/tokenizer/make_corpus.mjs");
    process.exit(1);
  }
  console.log(`corpus.json up to date (${cases.length} strings, ${decode.length} id sequences)`);
} else {
  writeFileSync(corpusPath, text);
  console.log(`wrote ${corpusPath}: ${cases.length} strings, ${decode.length} id sequences`);
}

// The official Node SDK against the gateway: one scenario per run, its findings as one JSON line on
// stdout. Run from a directory where `npm install openai` was done (tests/test_openai_conformance.py).
import OpenAI from "openai";

const [, , baseURL, apiKey, scenario] = process.argv;
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 30_000 });
const model = "switchboard";
const WEATHER = {
  type: "function",
  function: {
    name: "get_weather", description: "The weather in a city.",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
};

function failure(e) {
  return { name: e.constructor.name, status: e.status ?? null, code: e.code ?? null, type: e.type ?? null,
           param: e.param ?? null, message: e.message };
}

async function plain() {
  const c = await client.chat.completions.create({ model, messages: [{ role: "user", content: "node plain" }] });
  return { content: c.choices[0].message.content, finish: c.choices[0].finish_reason, usage: c.usage };
}

async function streamed() {
  const stream = await client.chat.completions.create({
    model, messages: [{ role: "user", content: "node streamed" }], stream: true,
    stream_options: { include_usage: true },
  });
  let text = "", finish = null, usage = null;
  for await (const chunk of stream) {
    if (chunk.choices.length) {
      text += chunk.choices[0].delta.content ?? "";
      finish = chunk.choices[0].finish_reason ?? finish;
    }
    usage = chunk.usage ?? usage;
  }
  // The SDK's own helper, which assembles the chunks into a completion.
  const helper = await client.chat.completions.stream({
    model, messages: [{ role: "user", content: "node helper" }] }).finalChatCompletion();
  return { text, finish, usage, helper: helper.choices[0].message.content, helperFinish: helper.choices[0].finish_reason };
}

async function tools() {
  const messages = [{ role: "user", content: "node weather?" }];
  const first = await client.chat.completions.create({ model, messages, tools: [WEATHER] });
  const message = first.choices[0].message;
  messages.push(message);  // replayed as the SDK returned it: content null, tool_calls
  for (const call of message.tool_calls) {
    messages.push({ role: "tool", tool_call_id: call.id, content: "rain, 7 C" });
  }
  const second = await client.chat.completions.create({ model, messages, tools: [WEATHER] });
  return {
    finish: first.choices[0].finish_reason, content: message.content,
    calls: message.tool_calls.map((c) => [c.function.name, JSON.parse(c.function.arguments)]),
    answer: second.choices[0].message.content, answerFinish: second.choices[0].finish_reason,
  };
}

async function interrupted() {
  const headers = { "X-Session-Id": "node-cut" };
  const stream = await client.chat.completions.create(
    { model, messages: [{ role: "user", content: "node long" }], stream: true }, { headers });
  let text = "", finish = null, extra = null, stop = null;
  for await (const chunk of stream) {
    const choice = chunk.choices[0];
    text += choice.delta.content ?? "";
    if (stop === null && text.length > 30) {
      stop = client.chat.completions.create({ model, messages: [{ role: "user", content: "/stop" }] }, { headers });
    }
    if (choice.finish_reason) {
      finish = choice.finish_reason;
      extra = chunk.switchboard ?? null;
    }
  }
  const stopped = await stop;
  return { finish, extra, text, stop: stopped.choices[0].message.content };
}

async function errors() {
  const out = {};
  try {
    await client.chat.completions.create({ model: "gpt-4o", messages: [{ role: "user", content: "hi" }] });
  } catch (e) { out.model = failure(e); }
  try {
    await new OpenAI({ baseURL, apiKey: "wrong", maxRetries: 0 }).models.list();
  } catch (e) { out.auth = failure(e); }
  try {
    await client.chat.completions.create({ model, messages: [{ role: "user", content: "hi" }], n: 2 });
  } catch (e) { out.param = failure(e); }
  try {
    const stream = await client.chat.completions.create(
      { model, messages: [{ role: "user", content: "node fail" }], stream: true });
    for await (const _chunk of stream) { /* until the error event */ }
  } catch (e) { out.stream = failure(e); }
  out.retrieved = (await client.models.retrieve(model)).id;
  out.listed = (await client.models.list()).data.map((m) => m.id);
  return out;
}

async function abort() {
  const controller = new AbortController();
  const stream = await client.chat.completions.create(
    { model, messages: [{ role: "user", content: "node abort" }], stream: true }, { signal: controller.signal });
  let text = "", error = null;
  try {
    for await (const chunk of stream) {
      text += chunk.choices[0]?.delta?.content ?? "";
      if (text.length > 30) controller.abort();
    }
  } catch (e) { error = e.constructor.name; }
  return { text, error, aborted: controller.signal.aborted };
}

async function responses() {
  const first = await client.responses.create({ model, input: "node first", instructions: "Be brief." });
  const second = await client.responses.create({ model, input: "node second", previous_response_id: first.id });
  const streamed = await client.responses.stream({ model, input: "node stream" }).finalResponse();
  const tool = { type: "function", name: WEATHER.function.name, description: WEATHER.function.description,
                 parameters: WEATHER.function.parameters };
  const input = [{ role: "user", content: "node weather?" }];
  const asked = await client.responses.create({ model, input, tools: [tool] });
  const calls = asked.output.filter((item) => item.type === "function_call");
  input.push(...calls);
  for (const call of calls) input.push({ type: "function_call_output", call_id: call.call_id, output: "rain, 7 C" });
  const answered = await client.responses.create({ model, input, tools: [tool] });
  return {
    first: [first.status, first.output_text, first.usage.output_tokens], second: second.output_text,
    chained: second.previous_response_id === first.id, streamed: [streamed.status, streamed.output_text],
    calls: calls.map((c) => [c.name, JSON.parse(c.arguments)]), answered: answered.output_text,
  };
}

const scenarios = { plain, streamed, tools, interrupted, errors, abort, responses };
try {
  console.log(JSON.stringify(await scenarios[scenario]()));
} catch (e) {
  console.log(JSON.stringify({ crashed: failure(e), stack: e.stack }));
  process.exitCode = 1;
}

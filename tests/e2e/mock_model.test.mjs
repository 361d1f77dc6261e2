// The mock upstream model server (fixtures/mock_model_server.mjs) driven by
// the unmodified official `openai` and `@anthropic-ai/sdk` clients: if these
// pass, the clients accept what the mock says, so the model-API proxy can be
// tested against it. Needs no sandgate binary; run by CTest as
// `e2e_js_mock_model`.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';
import { startMockModelServer } from './fixtures/mock_model_server.mjs';

const KEY = 'sk-mock-test';
let mock, openai, anthropic;

before(async () => {
  mock = await startMockModelServer({ apiKey: KEY });
  openai = new OpenAI({ baseURL: mock.url + '/v1', apiKey: KEY, maxRetries: 0 });
  anthropic = new Anthropic({ baseURL: mock.url, apiKey: KEY, maxRetries: 0 });
});

after(() => mock?.close());

const lastRequest = () => mock.requests.at(-1);

test('openai chat completion, non-streaming', async () => {
  const r = await openai.chat.completions.create({
    model: 'mock-gpt',
    messages: [
      { role: 'system', content: 'be brief' },
      { role: 'user', content: 'say   hello there' },
    ],
  });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices[0].message.content, 'mock reply 1 2 3');
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.deepEqual(
    [r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens],
    [5, 5, 10],
  );
  const req = lastRequest();
  assert.equal(req.method, 'POST');
  assert.equal(req.path, '/v1/chat/completions');
  assert.equal(req.headers.authorization, `Bearer ${KEY}`);
  assert.equal(req.body.model, 'mock-gpt');
});

test('openai chat completion, streaming with include_usage', async () => {
  const stream = await openai.chat.completions.create({
    model: 'mock-gpt',
    messages: [{ role: 'user', content: 'one two three' }],
    stream: true,
    stream_options: { include_usage: true },
  }, { headers: { 'x-mock-chunks': '7' } });
  let text = '';
  const usages = [];
  let finish = null;
  for await (const chunk of stream) {
    if (chunk.usage) usages.push(chunk.usage);
    for (const c of chunk.choices) {
      text += c.delta.content ?? '';
      finish = c.finish_reason ?? finish;
    }
  }
  assert.equal(text, 'mock reply 1 2 3 4 5');
  assert.equal(finish, 'stop');
  assert.equal(usages.length, 1);
  assert.deepEqual([usages[0].prompt_tokens, usages[0].completion_tokens], [3, 7]);
});

test('openai chat streaming without include_usage has no usage; max_tokens caps', async () => {
  const stream = await openai.chat.completions.create({
    model: 'mock-gpt',
    messages: [{ role: 'user', content: 'hi' }],
    max_tokens: 3,
    stream: true,
  });
  let text = '';
  let finish = null;
  for await (const chunk of stream) {
    assert.equal(chunk.usage, undefined);
    for (const c of chunk.choices) {
      text += c.delta.content ?? '';
      finish = c.finish_reason ?? finish;
    }
  }
  assert.equal(text, 'mock reply 1');
  assert.equal(finish, 'length');
});

test('openai responses, non-streaming and streaming', async () => {
  const r = await openai.responses.create({ model: 'mock-gpt', instructions: 'terse', input: 'what is up' });
  assert.equal(r.status, 'completed');
  assert.equal(r.output_text, 'mock reply 1 2 3');
  assert.deepEqual([r.usage.input_tokens, r.usage.output_tokens], [4, 5]);

  const stream = await openai.responses.create({ model: 'mock-gpt', input: 'what is up', stream: true });
  const types = [];
  let text = '';
  let completed;
  for await (const ev of stream) {
    types.push(ev.type);
    if (ev.type === 'response.output_text.delta') text += ev.delta;
    if (ev.type === 'response.completed') completed = ev.response;
  }
  assert.equal(types[0], 'response.created');
  assert.equal(types.at(-1), 'response.completed');
  assert.equal(types.filter((t) => t === 'response.output_text.delta').length, 5);
  assert.equal(text, 'mock reply 1 2 3');
  assert.deepEqual([completed.usage.input_tokens, completed.usage.output_tokens], [3, 5]);

  // The SDK's accumulating helper needs the item/part events too.
  const final = await openai.responses.stream({ model: 'mock-gpt', input: 'x' }).finalResponse();
  assert.equal(final.output_text, 'mock reply 1 2 3');
});

test('openai legacy completions', async () => {
  const r = await openai.completions.create({ model: 'mock-gpt', prompt: 'a b' });
  assert.equal(r.choices[0].text, 'mock reply 1 2 3');
  assert.deepEqual([r.usage.prompt_tokens, r.usage.completion_tokens], [2, 5]);
});

test('openai embeddings, base64 (SDK default) and float agree', async () => {
  const b64 = await openai.embeddings.create({ model: 'mock-gpt', input: ['alpha beta', 'gamma'] });
  assert.equal(lastRequest().body.encoding_format, 'base64');
  const flt = await openai.embeddings.create({ model: 'mock-gpt', input: ['alpha beta', 'gamma'], encoding_format: 'float' });
  assert.equal(b64.data.length, 2);
  assert.equal(b64.data[0].embedding.length, 8);
  assert.deepEqual(b64.data.map((d) => Array.from(d.embedding)), flt.data.map((d) => d.embedding));
  assert.notDeepEqual(flt.data[0].embedding, flt.data[1].embedding);
  assert.equal(flt.usage.prompt_tokens, 3);
});

test('models list, both dialects', async () => {
  const ids = [];
  for await (const m of openai.models.list()) ids.push(m.id);
  assert.deepEqual(ids, ['mock-gpt', 'mock-claude']);
  assert.equal((await openai.models.retrieve('mock-gpt')).owned_by, 'mock');

  const aids = [];
  for await (const m of anthropic.models.list()) aids.push(m.id);
  assert.deepEqual(aids, ['mock-gpt', 'mock-claude']);
});

test('anthropic message, non-streaming', async () => {
  const m = await anthropic.messages.create({
    model: 'mock-claude',
    max_tokens: 64,
    system: 'you are a mock',
    messages: [{ role: 'user', content: [{ type: 'text', text: 'hello there' }] }],
  }, { headers: { 'anthropic-beta': 'test-beta-2025-01-01' } });
  assert.equal(m.type, 'message');
  assert.deepEqual(m.content, [{ type: 'text', text: 'mock reply 1 2 3' }]);
  assert.equal(m.stop_reason, 'end_turn');
  assert.deepEqual([m.usage.input_tokens, m.usage.output_tokens], [6, 5]);
  const req = lastRequest();
  assert.equal(req.path, '/v1/messages');
  // @anthropic-ai/sdk 1.x sends an apiKey as Bearer, not x-api-key.
  assert.equal(req.headers.authorization, `Bearer ${KEY}`);
  assert.equal(req.headers['x-api-key'], undefined);
  assert.ok(req.headers['anthropic-version']);
  assert.equal(req.headers['anthropic-beta'], 'test-beta-2025-01-01');
});

test('anthropic message, streaming (messages.stream finalMessage)', async () => {
  const stream = anthropic.messages.stream({
    model: 'mock-claude',
    max_tokens: 64,
    messages: [{ role: 'user', content: 'count to three' }],
  }, { headers: { 'x-mock-chunks': '4', 'x-mock-chunk-delay-ms': '2' } });
  const types = [];
  stream.on('streamEvent', (ev) => types.push(ev.type));
  const final = await stream.finalMessage();
  assert.equal(final.content[0].text, 'mock reply 1 2');
  assert.deepEqual([final.usage.input_tokens, final.usage.output_tokens], [3, 4]);
  assert.equal(final.stop_reason, 'end_turn');
  assert.deepEqual(types, [
    'message_start', 'content_block_start',
    'content_block_delta', 'content_block_delta', 'content_block_delta', 'content_block_delta',
    'content_block_stop', 'message_delta', 'message_stop',
  ]);

  const capped = await anthropic.messages.stream({
    model: 'mock-claude', max_tokens: 2, messages: [{ role: 'user', content: 'x' }],
  }).finalMessage();
  assert.equal(capped.content[0].text, 'mock reply');
  assert.equal(capped.stop_reason, 'max_tokens');
});

test('anthropic x-api-key auth (0.x SDK style), and anthropicAuth restricting it', async () => {
  const post = (url, headers) => fetch(url + '/v1/messages', {
    method: 'POST',
    headers: { 'content-type': 'application/json', 'anthropic-version': '2023-06-01', ...headers },
    body: JSON.stringify({ model: 'mock-claude', max_tokens: 8, messages: [{ role: 'user', content: 'x' }] }),
  });
  const ok = await post(mock.url, { 'x-api-key': KEY });
  assert.equal(ok.status, 200);
  assert.equal((await ok.json()).content[0].text, 'mock reply 1 2 3');
  // x-api-key wins over Authorization when both are sent.
  assert.equal((await post(mock.url, { 'x-api-key': 'wrong', authorization: `Bearer ${KEY}` })).status, 401);

  const strict = await startMockModelServer({ anthropicAuth: 'x-api-key' });
  try {
    const r = await post(strict.url, { authorization: 'Bearer sk-mock' });
    assert.equal(r.status, 401);
    assert.equal((await r.json()).error.type, 'authentication_error');
    assert.equal((await post(strict.url, { 'x-api-key': 'sk-mock' })).status, 200);
  } finally {
    await strict.close();
  }
});

test('anthropic count_tokens', async () => {
  const r = await anthropic.messages.countTokens({
    model: 'mock-claude',
    system: 'sys prompt',
    messages: [{ role: 'user', content: 'a b c' }],
  });
  assert.deepEqual(r, { input_tokens: 5 });
});

test('wrong key: AuthenticationError 401 in both shapes', async () => {
  const badOpenai = new OpenAI({ baseURL: mock.url + '/v1', apiKey: 'sk-wrong', maxRetries: 0 });
  await assert.rejects(
    badOpenai.chat.completions.create({ model: 'mock-gpt', messages: [{ role: 'user', content: 'x' }] }),
    (e) => e instanceof OpenAI.AuthenticationError && e.status === 401 && e.code === 'invalid_api_key',
  );
  const badAnthropic = new Anthropic({ baseURL: mock.url, apiKey: 'sk-wrong', maxRetries: 0 });
  await assert.rejects(
    badAnthropic.messages.create({ model: 'mock-claude', max_tokens: 8, messages: [{ role: 'user', content: 'x' }] }),
    (e) => e instanceof Anthropic.AuthenticationError && e.status === 401 && e.error.error.type === 'authentication_error',
  );
});

test('unknown model: NotFoundError in both shapes', async () => {
  await assert.rejects(
    openai.chat.completions.create({ model: 'gpt-nope', messages: [{ role: 'user', content: 'x' }] }),
    (e) => e instanceof OpenAI.NotFoundError && e.code === 'model_not_found',
  );
  await assert.rejects(
    anthropic.messages.create({ model: 'claude-nope', max_tokens: 8, messages: [{ role: 'user', content: 'x' }] }),
    (e) => e instanceof Anthropic.NotFoundError && e.error.error.type === 'not_found_error',
  );
});

test('forced 500 / 429 / 529 in provider shape', async () => {
  const msg = [{ role: 'user', content: 'x' }];
  await assert.rejects(
    openai.chat.completions.create({ model: 'mock-gpt', messages: msg }, { headers: { 'x-mock-status': '500' } }),
    (e) => e instanceof OpenAI.InternalServerError && e.status === 500 && e.type === 'server_error',
  );
  await assert.rejects(
    openai.chat.completions.create({ model: 'mock-gpt', messages: msg, stream: true },
      { headers: { 'x-mock-status': '429', 'x-mock-retry-after': '7' } }),
    (e) => e instanceof OpenAI.RateLimitError && e.code === 'rate_limit_exceeded' && e.headers.get('retry-after') === '7',
  );
  await assert.rejects(
    anthropic.messages.create({ model: 'mock-claude', max_tokens: 8, messages: msg }, { headers: { 'x-mock-status': '429' } }),
    (e) => e instanceof Anthropic.RateLimitError && e.error.error.type === 'rate_limit_error',
  );
  await assert.rejects(
    anthropic.messages.create({ model: 'mock-claude', max_tokens: 8, messages: msg }, { headers: { 'x-mock-status': '529' } }),
    (e) => e instanceof Anthropic.APIError && e.status === 529 && e.error.error.type === 'overloaded_error',
  );
});

test('server-wide knobs apply to every request', async () => {
  const down = await startMockModelServer({ status: 503, chunks: 2 });
  try {
    const c = new OpenAI({ baseURL: down.url + '/v1', apiKey: 'sk-mock', maxRetries: 0 });
    await assert.rejects(c.models.list(), (e) => e.status === 503);
    const ok = await c.chat.completions.create({ model: 'mock-gpt', messages: [{ role: 'user', content: 'x' }] },
      { headers: { 'x-mock-status': '0' } });
    assert.equal(ok.choices[0].message.content, 'mock reply');
  } finally {
    await down.close();
  }
});

test('malformed JSON and missing anthropic-version: 400 in provider shape', async () => {
  const o = await fetch(mock.url + '/v1/chat/completions', {
    method: 'POST', headers: { authorization: `Bearer ${KEY}`, 'content-type': 'application/json' }, body: '{"model":',
  });
  assert.equal(o.status, 400);
  assert.equal((await o.json()).error.type, 'invalid_request_error');

  const a = await fetch(mock.url + '/v1/messages', {
    method: 'POST', headers: { 'x-api-key': KEY, 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'mock-claude', max_tokens: 8, messages: [] }),
  });
  assert.equal(a.status, 400);
  const body = await a.json();
  assert.equal(body.type, 'error');
  assert.equal(body.error.type, 'invalid_request_error');
  assert.match(body.error.message, /anthropic-version/);
});

test('mid-stream disconnect rejects the SDK stream iteration', async () => {
  const stream = await openai.chat.completions.create(
    { model: 'mock-gpt', messages: [{ role: 'user', content: 'x' }], stream: true },
    { headers: { 'x-mock-disconnect-after': '2' } },
  );
  let text = '';
  await assert.rejects(async () => {
    for await (const chunk of stream) text += chunk.choices[0]?.delta.content ?? '';
  });
  assert.equal(text, 'mock reply');

  const astream = anthropic.messages.stream(
    { model: 'mock-claude', max_tokens: 64, messages: [{ role: 'user', content: 'x' }] },
    { headers: { 'x-mock-disconnect-after': '3' } },
  );
  let atext = '';
  astream.on('text', (t) => { atext += t; });
  await assert.rejects(astream.finalMessage());
  assert.equal(atext, 'mock reply 1');
});

test('latency knob: first byte no earlier than asked', async () => {
  const t0 = performance.now();
  const res = await fetch(mock.url + '/v1/models', {
    headers: { authorization: `Bearer ${KEY}`, 'x-mock-latency-ms': '120' },
  });
  const headersAt = performance.now() - t0;
  await res.arrayBuffer();
  assert.equal(res.status, 200);
  assert.ok(headersAt >= 120, `headers after ${headersAt} ms, asked for 120`);

  const t1 = performance.now();
  const stream = await openai.chat.completions.create(
    { model: 'mock-gpt', messages: [{ role: 'user', content: 'x' }], stream: true },
    { headers: { 'x-mock-latency-ms': '80' } },
  );
  for await (const _ of stream) break;
  assert.ok(performance.now() - t1 >= 80);
});

test('raw SSE bytes are deterministic', async () => {
  const raw = async () => {
    const res = await fetch(mock.url + '/v1/chat/completions', {
      method: 'POST',
      headers: { authorization: `Bearer ${KEY}`, 'content-type': 'application/json' },
      body: JSON.stringify({
        model: 'mock-gpt', stream: true, stream_options: { include_usage: true },
        messages: [{ role: 'user', content: 'same input' }],
      }),
    });
    assert.equal(res.status, 200);
    assert.match(res.headers.get('content-type'), /^text\/event-stream/);
    return Buffer.from(await res.arrayBuffer());
  };
  const [a, b] = [await raw(), await raw()];
  assert.ok(a.equals(b));
  const frames = a.toString('utf8').split('\n\n').filter(Boolean);
  assert.ok(frames.every((f) => f.startsWith('data: ')));
  assert.equal(frames.at(-1), 'data: [DONE]');
  // role chunk, 5 text chunks, finish chunk, usage chunk, [DONE]
  assert.equal(frames.length, 9);
  assert.deepEqual(JSON.parse(frames.at(-2).slice(6)).usage.completion_tokens, 5);
});

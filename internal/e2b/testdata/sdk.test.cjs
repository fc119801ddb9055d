// The official E2B JavaScript SDK against dsec's E2B front, one test per
// feature the SDK offers and the front serves. Run by e2b.txtar with
// node --test, once per SDK release (NODE_PATH names its install), with
// E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set to a worker started
// with --e2b-listen; DSEC_E2B_TEMPLATE is a Debian template, DSEC_E2B_SMALL
// one with a small disk, DSEC_HOST_MARKER a host file no sandbox may read,
// DSEC_E2B_OTHER_KEY another token's key.
'use strict'
const { test, after } = require('node:test')
const assert = require('node:assert/strict')
const fs = require('node:fs')
const e2b = require('e2b')
const { Sandbox, CommandExitError } = e2b

const TEMPLATE = process.env.DSEC_E2B_TEMPLATE || 'base'
const VERSION = require('e2b/package.json').version
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

// Every sandbox a test makes is killed at the end, whatever happened.
const made = []
async function create(opts) {
  const sbx = await Sandbox.create(TEMPLATE, opts)
  made.push(sbx)
  return sbx
}
after(async () => {
  for (const sbx of made) await sbx.kill().catch(() => {})
})

test(`create, getInfo, metadata, envVars (e2b ${VERSION})`, async () => {
  const sbx = await create({ metadata: { suite: 'info', n: '1' }, envs: { CREATED: 'from-create' }, timeoutMs: 120_000 })
  assert.match(sbx.sandboxId, /^[a-z][a-z0-9]{19}$/)
  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.equal(info.templateId, TEMPLATE)
  assert.deepEqual(info.metadata, { suite: 'info', n: '1' })
  assert.equal(info.state, 'running')
  const left = new Date(info.endAt) - new Date(info.startedAt)
  assert.ok(left > 110_000 && left <= 121_000, `timeout ${left} ms`)
  const r = await sbx.commands.run('echo $CREATED')
  assert.equal(r.stdout, 'from-create\n')
  assert.equal(await sbx.isRunning(), true)
})

test('commands.run: output, exit codes, envs, cwd, users', async () => {
  const sbx = await create()
  const chunks = []
  const r = await sbx.commands.run('echo out; echo err >&2; echo $FOO', {
    envs: { FOO: 'bar' },
    onStdout: (d) => chunks.push(d),
  })
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'out\nbar\n')
  assert.equal(r.stderr, 'err\n')
  assert.equal(chunks.join(''), 'out\nbar\n')
  assert.equal((await sbx.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n')
  assert.equal((await sbx.commands.run('id -u', { user: 'root' })).stdout, '0\n')
  await sbx.commands.run('useradd -m agent')
  assert.equal((await sbx.commands.run('id -un; echo $HOME; pwd', { user: 'agent' })).stdout, 'agent\n/home/agent\n/home/agent\n')
  await assert.rejects(sbx.commands.run('true', { user: 'nosuch' }), (err) => err instanceof e2b.InvalidArgumentError || err instanceof e2b.SandboxError)
  await assert.rejects(sbx.files.read('/etc/hostname', { user: 'agent' }))
  await assert.rejects(sbx.commands.run('echo partial; exit 3'), (err) => {
    assert.ok(err instanceof CommandExitError, String(err))
    assert.equal(err.exitCode, 3)
    assert.equal(err.stdout, 'partial\n')
    return true
  })
  await assert.rejects(sbx.commands.run('no-such-command-here'), (err) => {
    assert.ok(err instanceof CommandExitError, String(err))
    assert.equal(err.exitCode, 127)
    assert.match(err.stderr, /not found/)
    return true
  })
  // The login shell the SDK runs (bash -l -c) sees a login environment.
  assert.equal((await sbx.commands.run('echo $HOME')).stdout, '/root\n')
})

test('commands.run: timeoutMs ends the command', async () => {
  const sbx = await create()
  const t0 = Date.now()
  await assert.rejects(sbx.commands.run('sleep 60', { timeoutMs: 1500 }))
  assert.ok(Date.now() - t0 < 15_000, `took ${Date.now() - t0} ms`)
  for (let i = 0; i < 50 && (await sbx.commands.list()).length > 0; i++) await sleep(100)
  assert.deepEqual(await sbx.commands.list(), [])
  const ps = await sbx.commands.run('ps -eo comm 2>/dev/null || ls /proc')
  assert.doesNotMatch(ps.stdout, /^sleep$/m)
})

test('background commands: wait, list, kill, stdin, connect', async () => {
  const sbx = await create()
  const h = await sbx.commands.run('sleep 0.3; echo done', { background: true })
  assert.ok(h.pid > 0)
  assert.equal((await h.wait()).stdout, 'done\n')

  const long = await sbx.commands.run('sleep 100', { background: true })
  const listed = await sbx.commands.list()
  assert.ok(listed.some((p) => p.pid === long.pid && p.cmd === '/bin/bash'), JSON.stringify(listed))
  assert.equal(await long.kill(), true)
  await assert.rejects(long.wait(), (err) => err instanceof CommandExitError && err.exitCode === 137)
  assert.ok(!(await sbx.commands.list()).some((p) => p.pid === long.pid))
  assert.equal(await sbx.commands.kill(long.pid), false) // ended: not found

  const cat = await sbx.commands.run('cat', { background: true, stdin: true })
  await sbx.commands.sendStdin(cat.pid, 'hello ')
  await sbx.commands.sendStdin(cat.pid, 'stdin\n')
  await sbx.commands.closeStdin(cat.pid)
  assert.equal((await cat.wait()).stdout, 'hello stdin\n')

  const ticker = await sbx.commands.run('for i in 1 2 3 4; do echo $i; sleep 0.3; done', { background: true })
  await ticker.disconnect()
  const again = await sbx.commands.connect(ticker.pid)
  assert.equal((await again.wait()).stdout, '1\n2\n3\n4\n')
  // Connecting to a command that ended replays it from the journal.
  const replay = await sbx.commands.connect(ticker.pid)
  assert.equal((await replay.wait()).stdout, '1\n2\n3\n4\n')
})

test('the same DSEC_EXEC_ID runs once', async () => {
  const sbx = await create()
  const step = { envs: { DSEC_EXEC_ID: 'rollout-1.step-1' } }
  const first = await sbx.commands.run('echo $RANDOM >> /tmp/ran; cat /tmp/ran; echo ${DSEC_EXEC_ID:-unset}', step)
  const second = await sbx.commands.run('echo $RANDOM >> /tmp/ran; cat /tmp/ran; echo ${DSEC_EXEC_ID:-unset}', step)
  assert.equal(second.stdout, first.stdout)
  assert.match(first.stdout, /^\d+\nunset\n$/)
  assert.equal((await sbx.files.read('/tmp/ran')).split('\n').filter(Boolean).length, 1)
})

test('files: write, read, list, makeDir, rename, remove, exists, getInfo', async () => {
  const sbx = await create()
  const w = await sbx.files.write('/tmp/deep/new/a.txt', 'hello')
  assert.equal(w.path, '/tmp/deep/new/a.txt')
  assert.equal(await sbx.files.read('/tmp/deep/new/a.txt'), 'hello')
  const bytes = Uint8Array.from([0, 1, 2, 250, 255])
  await sbx.files.write('/tmp/deep/bin', bytes.buffer)
  assert.deepEqual(Array.from(await sbx.files.read('/tmp/deep/bin', { format: 'bytes' })), Array.from(bytes))
  await sbx.files.write('relative.txt', 'home')
  assert.equal((await sbx.commands.run('cat /root/relative.txt')).stdout, 'home')
  const ents = await sbx.files.list('/tmp/deep')
  assert.deepEqual(ents.map((e) => `${e.name}:${e.type}`).sort(), ['bin:file', 'new:dir'])
  assert.equal(await sbx.files.makeDir('/tmp/deep/made/sub'), true)
  assert.equal(await sbx.files.makeDir('/tmp/deep/made/sub'), false)
  assert.equal(await sbx.files.exists('/tmp/deep/made/sub'), true)
  const info = await sbx.files.getInfo('/tmp/deep/bin')
  assert.equal(info.size, 5)
  assert.equal(info.type, 'file')
  const moved = await sbx.files.rename('/tmp/deep/bin', '/tmp/deep/made/bin2')
  assert.equal(moved.path, '/tmp/deep/made/bin2')
  assert.equal(await sbx.files.exists('/tmp/deep/bin'), false)
  await sbx.files.remove('/tmp/deep/made')
  assert.equal(await sbx.files.exists('/tmp/deep/made'), false)
  await assert.rejects(sbx.files.read('/tmp/nope'), (err) => err instanceof e2b.FileNotFoundError || err instanceof e2b.NotFoundError)
  await assert.rejects(sbx.files.read('/tmp/deep'), (err) => err instanceof e2b.InvalidArgumentError || err instanceof e2b.SandboxError) // a directory
  // A multi-file upload.
  await sbx.files.write([{ path: '/tmp/m/1', data: 'one' }, { path: '/tmp/m/2', data: 'two' }])
  assert.equal((await sbx.commands.run('cat /tmp/m/1 /tmp/m/2')).stdout, 'onetwo')
})

test('files: no path leads out of the sandbox', async () => {
  const sbx = await create()
  const marker = process.env.DSEC_HOST_MARKER
  assert.ok(marker && fs.existsSync(marker), 'DSEC_HOST_MARKER names a host file')
  await sbx.commands.run(`ln -s ${marker} /tmp/link; ln -s /../../../../../..${marker} /tmp/link2`)
  for (const p of ['/tmp/link', '/tmp/link2', `/../../../..${marker}`, `../../../../..${marker}`]) {
    let got = null
    try {
      got = await sbx.files.read(p)
    } catch (err) {
      assert.ok(err instanceof e2b.FileNotFoundError || err instanceof e2b.NotFoundError, `${p}: ${err}`)
    }
    assert.notEqual(got, fs.readFileSync(marker, 'utf8'), `${p} read the host's file`)
  }
  await sbx.files.write('/tmp/link-target-test', 'x')
  await sbx.files.write(`/../../../..${marker}`, 'overwritten')
  assert.notEqual(fs.readFileSync(marker, 'utf8'), 'overwritten')
})

test("another key sees nothing of a sandbox: not its info, processes, stdin or files", async () => {
  const other = process.env.DSEC_E2B_OTHER_KEY
  assert.ok(other, 'DSEC_E2B_OTHER_KEY is a second key')
  const sbx = await create()
  const h = await sbx.commands.run('cat', { background: true, stdin: true })
  await assert.rejects(Sandbox.connect(sbx.sandboxId, { apiKey: other }), (err) => err instanceof e2b.SandboxNotFoundError || err instanceof e2b.NotFoundError)
  assert.equal(await Sandbox.kill(sbx.sandboxId, { apiKey: other }), false)
  assert.ok(!(await Sandbox.list({ apiKey: other }).nextItems()).some((s) => s.sandboxId === sbx.sandboxId))
  const envd = (path, body, key) => fetch(process.env.E2B_SANDBOX_URL + path, {
    method: 'POST', body: JSON.stringify(body),
    headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49983', 'X-Access-Token': key,
      'Content-Type': 'application/json', 'Connect-Protocol-Version': '1' },
  })
  for (const [path, body] of [['/process.Process/List', {}], ['/process.Process/SendInput', { process: { pid: h.pid }, input: { stdin: 'aGkK' } }],
    ['/process.Process/CloseStdin', { process: { pid: h.pid } }], ['/filesystem.Filesystem/Stat', { path: '/etc/hostname' }]]) {
    const res = await envd(path, body, other)
    const text = await res.text()
    assert.equal(res.status, 404, `${path}: ${res.status} ${text}`)
    assert.equal(JSON.parse(text).code, 'not_found')
  }
  const files = await fetch(`${process.env.E2B_SANDBOX_URL}/files?path=/etc/hostname`, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'X-Access-Token': other } })
  assert.equal(files.status, 404)
  const none = await envd('/process.Process/List', {}, 'e2b_' + '1'.repeat(40))
  assert.equal(none.status, 401)
  // The owner's own still works: the command got nothing from the other key.
  await sbx.commands.sendStdin(h.pid, 'mine\n')
  await sbx.commands.closeStdin(h.pid)
  assert.equal((await h.wait()).stdout, 'mine\n')
})

test('pause keeps processes and memory; connect resumes them', async () => {
  const sbx = await create()
  await sbx.commands.run('x=0; while true; do x=$((x+1)); echo $x > /tmp/count; sleep 0.1; done', { background: true })
  await sleep(600)
  assert.equal(await sbx.pause(), true)
  assert.equal((await sbx.getInfo()).state, 'paused')
  const frozen = await sbx.files.read('/tmp/count')
  await sleep(700)
  assert.equal(await sbx.files.read('/tmp/count'), frozen, 'the counter ran while paused')
  assert.equal(await Sandbox.pause(sbx.sandboxId), false) // paused already: 409
  const back = await Sandbox.connect(sbx.sandboxId)
  assert.equal((await back.getInfo()).state, 'running')
  await sleep(700)
  const after = Number((await back.files.read('/tmp/count')).trim())
  assert.ok(after > Number(frozen.trim()), `counter ${frozen.trim()} -> ${after}`)
  // The same process, continued: its shell kept its own count.
  assert.ok(after - Number(frozen.trim()) < 30, 'it restarted rather than resumed')
})

test('setTimeout: a sandbox past its timeout is removed, or paused where asked', async () => {
  const gone = await create()
  await gone.setTimeout(1500)
  const paused = await create({ lifecycle: { onTimeout: 'pause' } }).catch(() => null)
  if (paused) await paused.setTimeout(1500)
  await sleep(4000)
  await assert.rejects(Sandbox.connect(gone.sandboxId), (err) => err instanceof e2b.SandboxNotFoundError || err instanceof e2b.NotFoundError)
  assert.equal(await Sandbox.kill(gone.sandboxId), false)
  if (paused) assert.equal((await paused.getInfo()).state, 'paused')
})

test('Sandbox.list: paging and metadata filters', async () => {
  const suite = `list-${process.pid}-${Date.now()}`
  for (let i = 0; i < 3; i++) await create({ metadata: { suite, i: String(i) } })
  await create({ metadata: { suite: 'other' } })
  const pager = Sandbox.list({ query: { metadata: { suite } }, limit: 2 })
  const first = await pager.nextItems()
  assert.equal(first.length, 2)
  assert.equal(pager.hasNext, true)
  const second = await pager.nextItems()
  assert.equal(second.length, 1)
  assert.equal(pager.hasNext, false)
  const all = [...first, ...second]
  assert.deepEqual(all.map((s) => s.metadata.i).sort(), ['0', '1', '2'])
  assert.ok(all.every((s) => s.state === 'running' && s.templateId === TEMPLATE))
  const paused = await Sandbox.list({ query: { metadata: { suite }, state: ['paused'] } }).nextItems()
  assert.deepEqual(paused, [])
})

test('kill', async () => {
  const sbx = await Sandbox.create(TEMPLATE)
  assert.equal(await sbx.kill(), true)
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  await assert.rejects(sbx.getInfo())
})

test('createSnapshot and fork: dsec snapshots and branches', async () => {
  const sbx = await create()
  await sbx.files.write('/root/state.txt', 'step-7')
  if (typeof sbx.createSnapshot === 'function') {
    const snap = await sbx.createSnapshot()
    assert.ok(snap.snapshotId)
    const restored = await Sandbox.create(snap.snapshotId)
    made.push(restored)
    assert.equal(await restored.files.read('/root/state.txt'), 'step-7')
  }
  if (typeof sbx.fork === 'function') {
    const forks = await sbx.fork({ count: 2 })
    assert.equal(forks.length, 2)
    for (const f of forks) {
      assert.ok(!(f instanceof Error), String(f))
      made.push(f)
      assert.equal(await f.files.read('/root/state.txt'), 'step-7')
    }
    await forks[0].files.write('/root/state.txt', 'diverged')
    assert.equal(await forks[1].files.read('/root/state.txt'), 'step-7')
    assert.equal(await sbx.files.read('/root/state.txt'), 'step-7')
  }
})

test("dsec's extension: POST /sandboxes/{id}/grade grades in a fresh sandbox, on only what the carry rules take", async () => {
  const sbx = await create()
  await sbx.files.write('/root/answer', '42')
  await sbx.files.write('/root/check', 'hacked')
  const grade = (body, key) => fetch(`${process.env.E2B_API_URL}/sandboxes/${sbx.sandboxId}/grade`, {
    method: 'POST', body: JSON.stringify(body), headers: { 'X-API-KEY': key || process.env.E2B_API_KEY, 'Content-Type': 'application/json' },
  })
  const req = { grader: ['grader:1'], carry: ['/root/answer'], args: ['sh', '/opt/grader/grade'] }
  const res = await grade(req)
  const text = await res.text()
  assert.equal(res.status, 200, text)
  const g = JSON.parse(text)
  assert.equal(g.exit_code, 0, text)
  assert.ok(g.tamper.paths.some((p) => p.path === '/root/check' && p.change === 'added'), text)
  assert.equal(await sbx.files.read('/root/check'), 'hacked') // the sandbox as the agent left it
  assert.equal((await grade(req, process.env.DSEC_E2B_OTHER_KEY)).status, 404)
  assert.equal((await grade({ ...req, carry: ['root'] })).status, 400)
})

test('a full host: 429 with Retry-After, which the SDK retries, then RateLimitError', async () => {
  if (!process.env.DSEC_E2B_BIG) return // templates whose CPU requests do not fit together
  const big = await Sandbox.create(process.env.DSEC_E2B_BIG)
  made.push(big)
  const t0 = Date.now()
  await assert.rejects(Sandbox.create(process.env.DSEC_E2B_LATE), (err) => err instanceof e2b.RateLimitError)
  // Releases that retry on Retry-After (2.51.0 does; 2.39.0 does not read it) try three times more.
  const retries = fs.readFileSync(require.resolve('e2b'), 'utf8').includes('Retry-After')
  if (retries) assert.ok(Date.now() - t0 >= 3000, `gave up after ${Date.now() - t0} ms: the SDK did not retry on Retry-After`)
  assert.ok(!(await Sandbox.list().nextItems()).some((s) => s.templateId === process.env.DSEC_E2B_LATE))
  await big.kill()
})

test('bad input: the SDK error types, nothing left behind', async () => {
  const before = (await Sandbox.list().nextItems()).length
  await assert.rejects(Sandbox.create('no-such-template:1'), (err) => err instanceof e2b.SandboxError || err instanceof e2b.NotFoundError)
  await assert.rejects(
    Sandbox.create(TEMPLATE, { apiKey: 'e2b_' + '0'.repeat(40) }),
    (err) => err instanceof e2b.AuthenticationError,
  )
  assert.equal((await Sandbox.list().nextItems()).length, before)
  if (process.env.DSEC_E2B_SMALL) {
    const small = await Sandbox.create(process.env.DSEC_E2B_SMALL)
    made.push(small)
    const big = new Uint8Array(80 << 20).fill(7)
    await assert.rejects(small.files.write('/root/big', big.buffer), (err) => err instanceof e2b.NotEnoughSpaceError)
    assert.equal(await small.files.exists('/root/big'), false)
    assert.equal((await small.commands.run('ls -A /root | grep -c dsec-put || true')).stdout.trim(), '0')
  }
})

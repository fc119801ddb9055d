// The official E2B JavaScript SDK against a dsec worker, unchanged: a
// sandbox from a template, two commands (one step with an exec id, which
// runs once however often it is retried), a file written and read back.
//
//   dsec daemon --e2b-listen 127.0.0.1:3000 &      # a config names the template base (docs/e2b.md)
//   export E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000
//   export E2B_API_KEY=$(dsec token create --e2b)
//   npm install e2b && node hello.cjs
const { Sandbox } = require('e2b')

async function main() {
  const sbx = await Sandbox.create('base', { timeoutMs: 600_000 })
  try {
    const r = await sbx.commands.run('echo hello from $(uname -n)')
    console.log(r.stdout.trim())
    const step = { envs: { DSEC_EXEC_ID: 'rollout-7.step-1' } }
    const first = await sbx.commands.run('date +%s%N > /tmp/ran; cat /tmp/ran', step)
    const again = await sbx.commands.run('date +%s%N > /tmp/ran; cat /tmp/ran', step)
    console.log(first.stdout === again.stdout ? 'the step ran once' : 'the step ran twice')
    await sbx.files.write('/tmp/note.txt', 'written through E2B')
    console.log(await sbx.files.read('/tmp/note.txt'))
  } finally {
    await sbx.kill()
  }
}

main().catch((e) => { console.error(e); process.exit(1) })

// make demo's E2B stage: the official E2B SDK, unchanged, against the
// local worker's E2B front (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY).
'use strict'
const { Sandbox, CommandExitError } = require('e2b')

async function main() {
  const sbx = await Sandbox.create('base', { metadata: { demo: 'e2b' }, timeoutMs: 300_000 })
  console.log(`created ${sbx.sandboxId} (also in dsec ps)`)
  const r = await sbx.commands.run('echo "hello from $(. /etc/os-release; echo $PRETTY_NAME)"; uname -r')
  process.stdout.write(r.stdout)
  await sbx.files.write('/work/notes.txt', 'step 1 done\n')
  console.log('files.read:', (await sbx.files.read('/work/notes.txt')).trim())
  try {
    await sbx.commands.run('exit 3')
  } catch (err) {
    if (!(err instanceof CommandExitError)) throw err
    console.log('a failing command raises CommandExitError, exit code', err.exitCode)
  }
  const step = { envs: { DSEC_EXEC_ID: 'demo.step-2' } }
  const a = await sbx.commands.run('date +%N', step)
  const b = await sbx.commands.run('date +%N', step)
  console.log('DSEC_EXEC_ID ran once:', a.stdout === b.stdout)
  const counter = await sbx.commands.run('i=0; while :; do i=$((i+1)); echo $i > /tmp/i; sleep 0.1; done', { background: true })
  await new Promise((res) => setTimeout(res, 500))
  await sbx.pause()
  const at = (await sbx.files.read('/tmp/i')).trim()
  console.log(`paused at ${at}: state ${(await sbx.getInfo()).state}`)
  const back = await Sandbox.connect(sbx.sandboxId)
  await new Promise((res) => setTimeout(res, 500))
  console.log(`resumed: the same process counts on, ${at} -> ${(await back.files.read('/tmp/i')).trim()}`)
  await back.commands.kill(counter.pid)
  const [fork] = await back.fork({ count: 1 })
  console.log(`fork ${fork.sandboxId}:`, (await fork.files.read('/work/notes.txt')).trim())
  await fork.kill()
  await back.kill()
  console.log('killed; E2B sandboxes left:', (await Sandbox.list().nextItems()).length)
}
main().catch((err) => {
  console.error(err)
  process.exit(1)
})

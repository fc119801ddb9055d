// A command survives the worker: "start" runs one in the background and
// notes its sandbox and pid in STATE, then goes; after the worker is
// killed and started again, "finish" reattaches by pid (Process.Connect)
// and must get the command's whole output and exit code from the
// sandbox's journal, though no front followed it meanwhile.
'use strict'
const assert = require('node:assert/strict')
const fs = require('node:fs')
const { Sandbox, CommandExitError } = require('e2b')

const [mode, state] = process.argv.slice(2)
const want = Array.from({ length: 10 }, (_, i) => `${i + 1}\n`).join('')

async function main() {
  if (mode === 'start') {
    const sbx = await Sandbox.create(process.env.DSEC_E2B_TEMPLATE, { timeoutMs: 600_000 })
    const h = await sbx.commands.run('for i in $(seq 1 10); do echo $i; sleep 0.3; done; exit 7', { background: true })
    fs.writeFileSync(state, JSON.stringify({ id: sbx.sandboxId, pid: h.pid }))
    await h.disconnect()
    return
  }
  const { id, pid } = JSON.parse(fs.readFileSync(state, 'utf8'))
  const sbx = await Sandbox.connect(id)
  const h = await sbx.commands.connect(pid)
  await assert.rejects(h.wait(), (err) => {
    assert.ok(err instanceof CommandExitError, String(err))
    assert.equal(err.exitCode, 7)
    assert.equal(err.stdout, want)
    return true
  })
  await sbx.kill()
  console.log('reattached: exit 7, all output')
}
main().catch((err) => {
  console.error(err)
  process.exit(1)
})

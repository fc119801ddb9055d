// The E2B front over TLS (https://, the CA in NODE_EXTRA_CA_CERTS): a
// create, a command and a kill.
'use strict'
const assert = require('node:assert/strict')
const { Sandbox } = require('e2b')

async function main() {
  const sbx = await Sandbox.create(process.env.DSEC_E2B_TEMPLATE)
  assert.equal((await sbx.commands.run('echo over tls')).stdout, 'over tls\n')
  assert.equal(await sbx.kill(), true)
  console.log('tls: ok')
}
main().catch((err) => {
  console.error(err)
  process.exit(1)
})

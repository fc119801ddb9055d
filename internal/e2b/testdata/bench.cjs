// E2B SDK figures against dsec's E2B front, printed as JSON (sdk's
// BenchmarkE2B runs it next to dsec's Go SDK on the same worker):
// Sandbox.create + the first commands.run('true') p50, commands.run('true')
// p50 in one sandbox, files.getInfo p50 (one unary request: the client's
// cost per request), and 100 sandboxes made at once from this process,
// each running 10 commands (sandboxes/s, commands/s).
//
//   node bench.cjs TEMPLATE [N]   (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY)
'use strict'
const { Sandbox } = require('e2b')

const [template, n = '50'] = process.argv.slice(2)
const p50 = (d) => d.sort((a, b) => a - b)[Math.floor(d.length / 2)]
const now = () => Number(process.hrtime.bigint()) / 1e6

async function main() {
  const first = []
  for (let i = 0; i < Math.max(5, Number(n) / 5); i++) {
    const t0 = now()
    const sbx = await Sandbox.create(template)
    await sbx.commands.run('true')
    first.push(now() - t0)
    await sbx.kill()
  }
  const sbx = await Sandbox.create(template)
  await sbx.commands.run('true')
  const run = []
  for (let i = 0; i < Number(n); i++) {
    const t0 = now()
    await sbx.commands.run('true')
    run.push(now() - t0)
  }
  const stat = []
  for (let i = 0; i < Number(n); i++) {
    const t0 = now()
    await sbx.files.getInfo('/tmp')
    stat.push(now() - t0)
  }
  await sbx.kill()
  const t0 = now()
  const made = await Promise.all(Array.from({ length: 100 }, () => Sandbox.create(template)))
  const created = now() - t0
  await Promise.all(made.map(async (s) => { for (let i = 0; i < 10; i++) await s.commands.run('true') }))
  const all = now() - t0
  await Promise.all(made.map((s) => s.kill()))
  console.log(JSON.stringify({
    create_first_p50_ms: p50(first), run_p50_ms: p50(run), stat_p50_ms: p50(stat),
    sandboxes_per_s: 100 / (created / 1000), commands_per_s: 1000 / ((all - created) / 1000),
  }))
}
main().catch((err) => { console.error(err); process.exit(1) })

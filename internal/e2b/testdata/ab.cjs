// Two workers' E2B fronts, their requests alternating one by one (A then
// B, then B then A), so that what the machine does meanwhile falls on
// both alike (scripts/ab-exec.sh starts the workers): Sandbox.create +
// the first commands.run('true'), then commands.run('true') in one
// sandbox of each. Prints JSON: each side's p50, B/A of the p50s and the
// median of the per-turn ratios.
//
//   node ab.cjs TEMPLATE N URL-A KEY-A URL-B KEY-B
'use strict'
const { Sandbox } = require('e2b')

const [template, n, urlA, keyA, urlB, keyB] = process.argv.slice(2)
const now = () => Number(process.hrtime.bigint()) / 1e6
const p50 = (d) => [...d].sort((a, b) => a - b)[Math.floor((d.length - 1) / 2)]
const sides = [{ apiUrl: urlA, sandboxUrl: urlA, apiKey: keyA }, { apiUrl: urlB, sandboxUrl: urlB, apiKey: keyB }]

// alternate times step(i) for side i, turns times after warm ones; what
// a step returns, if a function, runs after its time is taken.
async function alternate(turns, warm, step) {
  const d = [[], []]
  const ratios = []
  for (let k = 0; k < warm + turns; k++) {
    const t = [0, 0]
    for (const i of k % 2 ? [1, 0] : [0, 1]) {
      const t0 = now()
      const after = await step(i)
      t[i] = now() - t0
      if (typeof after === 'function') await after()
    }
    if (k >= warm) {
      d[0].push(t[0])
      d[1].push(t[1])
      ratios.push(t[1] / t[0])
    }
  }
  return { a_p50_ms: p50(d[0]), b_p50_ms: p50(d[1]), b_a_p50: p50(d[1]) / p50(d[0]), b_a_median_of_turns: p50(ratios) }
}

async function main() {
  const create = await alternate(Number(n), 4, async (i) => {
    const s = await Sandbox.create(template, sides[i])
    await s.commands.run('true')
    return () => s.kill()
  })
  const sbs = [await Sandbox.create(template, sides[0]), await Sandbox.create(template, sides[1])]
  try {
    const run = await alternate(5 * Number(n), 10, async (i) => { await sbs[i].commands.run('true') })
    console.log(JSON.stringify({ create_first: create, run }))
  } finally {
    await Promise.all(sbs.map((s) => s.kill()))
  }
}
main().catch((err) => { console.error(err); process.exit(1) })

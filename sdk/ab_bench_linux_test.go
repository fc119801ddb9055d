package sdk_test

import (
	"cmp"
	"context"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/sdk"
)

// BenchmarkExecAB: a create and its first exec, a create alone, then
// exec of true in a sandbox, on each of two workers (two builds: scripts/ab-exec.sh
// starts them), one each in turn, A then B, then B then A, so that what
// the machine does meanwhile falls on both alike. Run one after the other instead, two builds' figures on
// this VM move by 10% between runs and a change of a few percent is
// not seen. DSEC_AB_A and DSEC_AB_B are each a root or
// "tcp://HOST:PORT|TOKEN" (with DSEC_AB_CA), DSEC_AB_LAYER the layer
// (default bench:1). Reports each side's p50 and p99, B/A of the p50s
// and the median of the per-turn ratios. Without them: skipped.
func BenchmarkExecAB(b *testing.B) {
	targets := []string{os.Getenv("DSEC_AB_A"), os.Getenv("DSEC_AB_B")}
	if targets[0] == "" || targets[1] == "" {
		b.Skip("DSEC_AB_A and DSEC_AB_B name no workers: scripts/ab-exec.sh runs this benchmark")
	}
	layer := os.Getenv("DSEC_AB_LAYER")
	if layer == "" {
		layer = "bench:1"
	}
	ctx := context.Background()
	var cs [2]*sdk.Client
	var sbs [2]*sdk.Sandbox
	spec := api.SandboxSpec{Layers: []string{layer}}
	for i, t := range targets {
		o := sdk.Options{Root: t}
		if host, tok, ok := strings.Cut(t, "|"); ok {
			o = sdk.Options{Host: host, Token: tok, TLSCA: os.Getenv("DSEC_AB_CA")}
		}
		var err error
		if cs[i], err = sdk.New(o); err != nil {
			b.Fatal(err)
		}
		if sbs[i], err = cs[i].Create(ctx, spec); err != nil {
			b.Fatal(err)
		}
		defer sbs[i].Remove(ctx, true)
	}
	exec := func(sb *sdk.Sandbox) {
		if res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"true"}}); err != nil || res.ExitCode != 0 {
			b.Fatal(res, err)
		}
	}
	// A create and its first exec, DSEC_AB_CREATES turns (100); the
	// sandbox is removed after the time is taken.
	var made []*sdk.Sandbox
	newSandbox := func(i int) *sdk.Sandbox {
		sb, err := cs[i].Create(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		made = append(made, sb)
		return sb
	}
	removeMade := func() {
		for _, sb := range made {
			sb.Remove(ctx, true)
		}
		made = made[:0]
	}
	n, err := strconv.Atoi(cmp.Or(os.Getenv("DSEC_AB_CREATES"), "100"))
	if err != nil {
		b.Fatal("DSEC_AB_CREATES: ", err)
	}
	creates := alternate(2, func(k int) bool { return k < n }, func(i int) { exec(newSandbox(i)) }, removeMade)
	// Creates one after the other with no exec between them (a burst's),
	// removed five turns at a time: an odd number, so that A and B take
	// turns being first after a removal.
	createOnly := alternate(2, func(k int) bool { return k < n }, func(i int) { newSandbox(i) }, func() {
		if len(made) >= 10 {
			removeMade()
		}
	})
	removeMade()
	execs := alternate(20, func(int) bool { return b.Loop() }, func(i int) { exec(sbs[i]) }, nil)
	for name, f := range map[string]abFigure{"create": creates, "create-only": createOnly, "exec": execs} {
		report(b, name+"-a", f.d[0])
		report(b, name+"-b", f.d[1])
		b.ReportMetric(ms(p50(f.d[1]))/ms(p50(f.d[0])), name+"-b/a-p50")
		sort.Float64s(f.ratios)
		b.ReportMetric(f.ratios[len(f.ratios)/2], name+"-b/a-median-of-turns")
	}
}

// abFigure is the times of sides A and B, and their ratio per turn.
type abFigure struct {
	d      [2][]time.Duration
	ratios []float64
}

// alternate times step(i) for side 0 and 1 in turns, the first of a
// turn changing each turn: after warm turns, as long as more says, each
// turn's after (if set) untimed.
func alternate(warm int, more func(k int) bool, step func(i int), after func()) (f abFigure) {
	for k := 0; k < warm || more(k-warm); k++ {
		var t [2]time.Duration
		for _, i := range [2]int{k % 2, 1 - k%2} {
			t0 := time.Now()
			step(i)
			t[i] = time.Since(t0)
		}
		if after != nil {
			after()
		}
		if k < warm {
			continue
		}
		f.d[0], f.d[1] = append(f.d[0], t[0]), append(f.d[1], t[1])
		f.ratios = append(f.ratios, float64(t[1])/float64(t[0]))
	}
	return f
}

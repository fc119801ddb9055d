// Command benchtable keeps bench/results.json, the figures make bench
// measures, and the table at the top of BENCHMARKS.md made from it.
//
//	benchtable record --id ID --area AREA --title TITLE --value V[,V...] --unit U \
//		[--baseline V[,V...] --baseline-what WHAT] [--ratio R[,R...]] [--ratio-of baseline/dsec] \
//		[--target '<= 0.2x' --target-text TEXT] --command CMD --machine M [--date YYYY-MM-DD]
//	benchtable render [--check]
//
// record puts one figure in the results file (scripts/bench-lib.sh's
// bench_record, called by each scripts/bench-*.sh where it prints the
// figure); several values are runs. render writes the table between the
// markers of BENCHMARKS.md; with --check it only says whether it is stale.
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: benchtable record|render [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "record":
		err = record(os.Args[2:])
	case "render":
		err = render(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q: record or render", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchtable:", err)
		os.Exit(1)
	}
}

func record(args []string) error {
	fs := flag.NewFlagSet("record", flag.ContinueOnError)
	file := fs.String("file", "bench/results.json", "the results file")
	var f Figure
	var b Side
	var value, baseline, ratio, check, text string
	fs.StringVar(&f.ID, "id", "", "the figure's id")
	fs.StringVar(&f.Area, "area", "", "its area (a section of BENCHMARKS.md)")
	fs.StringVar(&f.Title, "title", "", "what it is")
	fs.StringVar(&value, "value", "", "dsec's value, one per run, comma-separated")
	fs.StringVar(&f.Dsec.Unit, "unit", "", "its unit")
	fs.StringVar(&f.Dsec.What, "what", "", "what dsec's side is, if the title does not say")
	fs.StringVar(&baseline, "baseline", "", "the baseline's value, one per run")
	fs.StringVar(&b.Unit, "baseline-unit", "", "its unit (the value's by default)")
	fs.StringVar(&b.What, "baseline-what", "", "what the baseline is")
	fs.StringVar(&ratio, "ratio", "", "the ratio as the script printed it, one per run (taken from the values if not given)")
	fs.StringVar(&f.RatioOf, "ratio-of", "", RatioDsec+" (the default), "+RatioBaseline+" or "+Difference)
	fs.StringVar(&check, "target", "", "the target's check: <= 0.2x (the ratio), <= +0.5 ms (the difference), <= 5% (the value)")
	fs.StringVar(&text, "target-text", "", "the target as the table says it (the check by default)")
	fs.StringVar(&f.Command, "command", "", "the command that reproduces it")
	fs.StringVar(&f.Machine, "machine", "", "the machine it ran on")
	fs.StringVar(&f.Date, "date", time.Now().UTC().Format(time.DateOnly), "the day it ran")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var err error
	if f.Dsec.Values, err = nums(value, ""); err != nil {
		return fmt.Errorf("%s: --value: %w", f.ID, err)
	}
	if len(f.Dsec.Values) == 0 {
		return fmt.Errorf("%s: no value (did its benchmark run?)", f.ID)
	}
	if baseline != "" || b.What != "" {
		if b.Values, err = nums(baseline, ""); err != nil {
			return fmt.Errorf("%s: --baseline: %w", f.ID, err)
		}
		if b.Unit == "" {
			b.Unit = f.Dsec.Unit
		}
		f.Baseline = &b
	}
	if f.Ratio, err = nums(ratio, "x"); err != nil {
		return fmt.Errorf("%s: --ratio: %w", f.ID, err)
	}
	if check != "" || text != "" {
		if text == "" {
			text = check
		}
		f.Target = &Target{Text: text, Check: check}
	}
	if f.Command == "" || f.Machine == "" {
		return fmt.Errorf("%s: --command and --machine are needed", f.ID)
	}
	r, err := Load(*file)
	if err != nil {
		return err
	}
	if err := r.Put(&f); err != nil {
		return err
	}
	return r.Save(*file)
}

// nums parses a comma-separated list of numbers, each without suffix
// (1.04x) or a leading plus.
func nums(s, suffix string) ([]Num, error) {
	var out []Num
	for v := range strings.SplitSeq(s, ",") {
		v = strings.TrimPrefix(strings.TrimSuffix(strings.TrimSpace(v), suffix), "+")
		if v == "" {
			continue
		}
		n := Num(v)
		if _, err := n.Float64(); err != nil {
			return nil, fmt.Errorf("%q is not a number", v)
		}
		out = append(out, n)
	}
	return out, nil
}

func render(args []string) error {
	fs := flag.NewFlagSet("render", flag.ContinueOnError)
	file := fs.String("file", "bench/results.json", "the results file")
	doc := fs.String("doc", "BENCHMARKS.md", "the document whose table to write")
	check := fs.Bool("check", false, "only say whether the table is stale")
	if err := fs.Parse(args); err != nil {
		return err
	}
	r, err := Load(*file)
	if err != nil {
		return err
	}
	old, err := os.ReadFile(*doc)
	if err != nil {
		return err
	}
	out, err := Splice(string(old), r.Render())
	if err != nil {
		return fmt.Errorf("%s: %w", *doc, err)
	}
	switch {
	case out == string(old):
		return nil
	case *check:
		return fmt.Errorf("%s: the table is not what %s gives: run make bench-table", *doc, *file)
	}
	return os.WriteFile(*doc, []byte(out), 0o644)
}

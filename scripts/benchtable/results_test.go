package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func fig(id, area string, dsec, base []Num, ratio []Num, check string) *Figure {
	f := &Figure{ID: id, Area: area, Title: id + " title", Dsec: Side{Values: dsec, Unit: "ms"},
		Ratio: ratio, Command: "scripts/bench-x.sh", Machine: "m", Date: "2026-12-01"}
	if base != nil {
		f.Baseline = &Side{What: "runc", Values: base, Unit: "ms"}
	}
	if check != "" {
		f.Target = &Target{Text: check, Check: check}
	}
	return f
}

func TestRender(t *testing.T) {
	r := &Results{}
	for _, f := range []*Figure{
		fig("a", "Sandboxes", []Num{"8.8", "8.4"}, []Num{"36.3", "34.6"}, []Num{"0.24", "0.24"}, "<= 0.25x"),
		fig("b", "Layer build", []Num{"697"}, []Num{"614"}, []Num{"0.88"}, ">= 1.5x"),
		fig("c", "Sandboxes", []Num{"1000"}, nil, nil, ""),
	} {
		if err := r.Put(f); err != nil {
			t.Fatal(err)
		}
	}
	r.Figures[2].RatioOf = RatioBaseline
	r.Figures[1].Command = "go test -bench 'A$|B$'"
	r.Figures[1].Machine = "the other"
	want := Begin + `
| area | figure | dsec | baseline | ratio | target | met | command | machine | date |
|---|---|---|---|---|---|---|---|---|---|
| [Sandboxes](#sandboxes) | a title | 8.8 / 8.4 ms | runc: 36.3 / 34.6 ms | 0.24 / 0.24x | <= 0.25x | met | ` + "`scripts/bench-x.sh`" + ` | M1 | 2026-12-01 |
|  | c title | 1000 ms |  |  |  |  | ` + "`go test -bench 'A$\\|B$'`" + ` | M2 | 2026-12-01 |
| [Layer build](#layer-build) | b title | 697 ms | runc: 614 ms | 0.88x (baseline/dsec) | >= 1.5x | **not met** | ` + "`scripts/bench-x.sh`" + ` | M1 | 2026-12-01 |

Several values in a cell are runs of the same command, in order; a target is checked on their median.
Machines:

- M1: m
- M2: the other
` + End + "\n"
	if got := r.Render(); got != want {
		t.Errorf("Render:\n%s\nwant:\n%s", got, want)
	}
}

func TestCheck(t *testing.T) {
	for _, c := range []struct {
		check   string
		ratioOf string
		dsec    []Num
		base    []Num
		ratio   []Num
		met     bool
		bad     bool
	}{
		{check: "<= 0.25x", ratio: []Num{"0.24", "0.30", "0.22"}, met: true},
		{check: "<= 0.25x", ratio: []Num{"0.24", "0.30", "0.26"}, met: false},
		{check: ">= 1.5x", ratioOf: RatioBaseline, ratio: []Num{"1.92"}, met: true},
		{check: "< 200 ms", dsec: []Num{"64.7"}, met: true},
		{check: "<= 5 ms", dsec: []Num{"5.01"}, met: false},
		{check: ">= 1000", dsec: []Num{"1000"}, met: true},
		{check: "<= +0.5 ms", dsec: []Num{"9.88", "10.78"}, base: []Num{"10.12", "8.85"}, met: false}, // median +0.845
		{check: "<= +0.5 ms", ratioOf: Difference, ratio: []Num{"-0.24", "-0.23", "1.93"}, met: true},
		{check: "<= +2 ms", dsec: []Num{"3.84"}, base: []Num{"3.95"}, ratio: []Num{"0.97"}, met: true},
		{check: "<= 5 GiB", dsec: []Num{"1"}, bad: true},
		{check: "about 5", dsec: []Num{"1"}, bad: true},
		{check: "<= 1.1x", dsec: []Num{"1"}, bad: true},
	} {
		f := fig("x", "A", c.dsec, c.base, c.ratio, c.check)
		f.RatioOf = c.ratioOf
		if f.Dsec.Values == nil {
			f.Dsec.Values = []Num{"1"}
		}
		err := f.complete()
		if c.bad {
			if err == nil {
				t.Errorf("%s: no error", c.check)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", c.check, err)
			continue
		}
		if *f.Met != c.met {
			t.Errorf("%s on %v %v %v: met %v, want %v", c.check, c.dsec, c.base, c.ratio, *f.Met, c.met)
		}
	}
}

func TestPutAndSave(t *testing.T) {
	path := filepath.Join(t.TempDir(), "results.json")
	r := &Results{}
	for _, f := range []*Figure{
		fig("a", "A", []Num{"1.00"}, []Num{"2"}, nil, "<= 0.6x"),
		fig("b", "B", []Num{"3"}, nil, nil, ""),
	} {
		if err := r.Put(f); err != nil {
			t.Fatal(err)
		}
	}
	if got := string(r.Figures[0].Ratio[0]); got != "0.500" {
		t.Errorf("ratio taken from the values: %s", got)
	}
	if err := r.Save(path); err != nil {
		t.Fatal(err)
	}
	// A run records a's values alone: its title, target and baseline's what stay; a new figure of area A goes
	// after a, before B's.
	r, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	a := &Figure{ID: "a", Dsec: Side{Values: []Num{"1.50"}}, Baseline: &Side{Values: []Num{"2"}}, Command: "c", Machine: "m2", Date: "d"}
	if err := r.Put(a); err != nil {
		t.Fatal(err)
	}
	if err := r.Put(fig("a2", "A", []Num{"5"}, nil, nil, "")); err != nil {
		t.Fatal(err)
	}
	if err := r.Save(path); err != nil {
		t.Fatal(err)
	}
	if r, err = Load(path); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, f := range r.Figures {
		ids = append(ids, f.ID)
	}
	if got := strings.Join(ids, " "); got != "a a2 b" {
		t.Errorf("order %q", got)
	}
	f := r.Figures[0]
	if f.Title != "a title" || f.Dsec.Unit != "ms" || f.Baseline.What != "runc" || f.Target.Check != "<= 0.6x" ||
		string(f.Dsec.Values[0]) != "1.50" || string(f.Ratio[0]) != "0.750" || *f.Met || f.Machine != "m2" {
		t.Errorf("merged: %+v %+v %+v", f, f.Baseline, f.Target)
	}
	b, _ := os.ReadFile(path)
	if !strings.Contains(string(b), `"values": [1.50],`) || strings.Contains(string(b), `\u003c`) {
		t.Errorf("file:\n%s", b)
	}
}

// The table in BENCHMARKS.md is what bench/results.json gives (make
// bench-table), and each of its areas has notes of its own.
func TestCommitted(t *testing.T) {
	r, err := Load("../../bench/results.json")
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile("../../BENCHMARKS.md")
	if err != nil {
		t.Fatal(err)
	}
	out, err := Splice(string(doc), r.Render())
	if err != nil {
		t.Fatal(err)
	}
	if out != string(doc) {
		t.Error("BENCHMARKS.md's table is not what bench/results.json gives: run make bench-table")
	}
	for _, f := range r.Figures {
		if !strings.Contains(string(doc), "\n## "+f.Area+"\n") {
			t.Errorf("%s: no section %q in BENCHMARKS.md", f.ID, "## "+f.Area)
		}
		if f.Target != nil && f.Target.Check != "" && f.Met == nil {
			t.Errorf("%s: a check but no met", f.ID)
		}
	}
}

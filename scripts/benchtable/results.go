package main

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// Results is bench/results.json: every figure make bench records, in the
// order the table shows them (grouped by area, areas in the order they
// first appear).
type Results struct {
	Comment string    `json:"comment,omitempty"`
	Figures []*Figure `json:"figures"`
}

// Figure is one figure: dsec's value against its baseline, measured by
// Command on Machine on Date. Values hold one entry per run.
type Figure struct {
	ID       string  `json:"id"`
	Area     string  `json:"area"`
	Title    string  `json:"title"`
	Dsec     Side    `json:"dsec"`
	Baseline *Side   `json:"baseline,omitempty"`
	RatioOf  string  `json:"ratio_of,omitempty"` // RatioDsec (the default), RatioBaseline or Difference
	Ratio    []Num   `json:"ratio,omitempty"`
	Target   *Target `json:"target,omitempty"`
	Met      *bool   `json:"met,omitempty"` // set from Target.Check; absent without one
	Command  string  `json:"command"`
	Machine  string  `json:"machine"`
	Date     string  `json:"date"`
}

// Side is what one side measured: one value per run, in Unit.
type Side struct {
	What   string `json:"what,omitempty"`
	Values []Num  `json:"values,omitempty"`
	Unit   string `json:"unit,omitempty"`
}

// Target is a figure's target as the notes state it (Text) and as a check
// on the median of the runs (Check: "<= 0.2x" checks the ratio, "<= +0.5 ms"
// the difference dsec - baseline, "<= 5%" or ">= 1000" dsec's value).
type Target struct {
	Text  string `json:"text"`
	Check string `json:"check,omitempty"`
}

// Num is a number as written, so that 1.00 stays 1.00.
type Num = json.Number

// How a figure's ratio is taken.
const (
	RatioDsec     = "dsec/baseline"
	RatioBaseline = "baseline/dsec"
	Difference    = "dsec-baseline"
)

// Load reads a results file; a missing one is empty.
func Load(path string) (*Results, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return &Results{}, nil
	}
	if err != nil {
		return nil, err
	}
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	d.DisallowUnknownFields()
	var r Results
	if err := d.Decode(&r); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	for _, f := range r.Figures {
		if err := f.validate(); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
	}
	return &r, nil
}

// Save writes r to path in place (a results file made by a user keeps its
// owner when a benchmark run as root records into it).
func (r *Results) Save(path string) error {
	var b bytes.Buffer
	e := json.NewEncoder(&b)
	e.SetEscapeHTML(false)
	e.SetIndent("", "  ")
	if err := e.Encode(r); err != nil {
		return err
	}
	// Lists of numbers on one line each.
	out := numList.ReplaceAllFunc(b.Bytes(), func(m []byte) []byte {
		return slices.Concat([]byte("["), bytes.Join(number.FindAll(m, -1), []byte(", ")), []byte("]"))
	})
	return os.WriteFile(path, out, 0o644)
}

var (
	number  = regexp.MustCompile(`-?[0-9][0-9.eE+-]*`)
	numList = regexp.MustCompile(`\[\s*` + number.String() + `(,\s*` + number.String() + `)*\s*\]`)
)

// Put records f: it replaces the figure of its ID where that one stands,
// keeping what f leaves empty (area, title, the baseline's description,
// the target), or is appended after the last figure of its area.
func (r *Results) Put(f *Figure) error {
	i := slices.IndexFunc(r.Figures, func(g *Figure) bool { return g.ID == f.ID })
	if i >= 0 {
		old := r.Figures[i]
		f.Area = cmp.Or(f.Area, old.Area)
		f.Title = cmp.Or(f.Title, old.Title)
		f.Dsec.What = cmp.Or(f.Dsec.What, old.Dsec.What)
		f.Dsec.Unit = cmp.Or(f.Dsec.Unit, old.Dsec.Unit)
		if f.Baseline != nil && old.Baseline != nil {
			f.Baseline.What = cmp.Or(f.Baseline.What, old.Baseline.What)
			f.Baseline.Unit = cmp.Or(f.Baseline.Unit, old.Baseline.Unit)
		}
		f.RatioOf = cmp.Or(f.RatioOf, old.RatioOf)
		if f.Target == nil {
			f.Target = old.Target
		}
	}
	if err := f.complete(); err != nil {
		return err
	}
	switch {
	case i >= 0:
		r.Figures[i] = f
	default:
		at := len(r.Figures)
		for j, g := range r.Figures {
			if g.Area == f.Area {
				at = j + 1
			}
		}
		r.Figures = slices.Insert(r.Figures, at, f)
	}
	return nil
}

// complete takes the ratio from the values when none was given, and
// whether the target is met.
func (f *Figure) complete() error {
	if err := f.validate(); err != nil {
		return err
	}
	if len(f.Ratio) == 0 && f.Baseline != nil && len(f.Baseline.Values) == len(f.Dsec.Values) {
		for i := range f.Dsec.Values {
			d, _ := f.Dsec.Values[i].Float64()
			b, _ := f.Baseline.Values[i].Float64()
			var v float64
			switch f.RatioOf {
			case Difference:
				f.Ratio = append(f.Ratio, Num(strconv.FormatFloat(d-b, 'f', 2, 64)))
				continue
			case RatioBaseline:
				v = b / d
			default:
				v = d / b
			}
			f.Ratio = append(f.Ratio, Num(strconv.FormatFloat(v, 'f', 3, 64)))
		}
	}
	f.Met = nil
	if f.Target != nil && f.Target.Check != "" {
		ok, err := f.check()
		if err != nil {
			return fmt.Errorf("%s: %w", f.ID, err)
		}
		f.Met = &ok
	}
	return nil
}

func (f *Figure) validate() error {
	if f.ID == "" || f.Area == "" || f.Title == "" {
		return fmt.Errorf("figure %q: id, area and title are needed", f.ID)
	}
	switch f.RatioOf {
	case "", RatioDsec, RatioBaseline, Difference:
	default:
		return fmt.Errorf("%s: ratio_of %q: not %s, %s or %s", f.ID, f.RatioOf, RatioDsec, RatioBaseline, Difference)
	}
	nums := slices.Concat(f.Dsec.Values, f.Ratio)
	if f.Baseline != nil {
		nums = slices.Concat(nums, f.Baseline.Values)
	}
	for _, n := range nums {
		if _, err := n.Float64(); err != nil {
			return fmt.Errorf("%s: %q is not a number", f.ID, n)
		}
	}
	return nil
}

var checkRE = regexp.MustCompile(`^(<=|>=|<|>)\s*([+-]?)([0-9]+(?:\.[0-9]+)?)\s*(.*)$`)

// check says whether the median of the runs meets the target's check.
func (f *Figure) check() (bool, error) {
	m := checkRE.FindStringSubmatch(strings.TrimSpace(f.Target.Check))
	if m == nil {
		return false, fmt.Errorf("check %q: not OP NUMBER[UNIT] (<= 0.2x, <= +0.5 ms, >= 1000)", f.Target.Check)
	}
	op, sign, unit := m[1], m[2], m[4]
	want, _ := strconv.ParseFloat(m[3], 64)
	if sign == "-" {
		want = -want
	}
	var got []Num
	switch {
	case unit == "x":
		if f.RatioOf == Difference {
			return false, fmt.Errorf("check %q: a ratio, but the figure is a difference", f.Target.Check)
		}
		got = f.Ratio
	case sign != "":
		if f.RatioOf != Difference {
			if f.Baseline == nil || len(f.Baseline.Values) != len(f.Dsec.Values) {
				return false, fmt.Errorf("check %q: a difference needs a baseline for each run", f.Target.Check)
			}
			for i := range f.Dsec.Values {
				d, _ := f.Dsec.Values[i].Float64()
				b, _ := f.Baseline.Values[i].Float64()
				got = append(got, Num(strconv.FormatFloat(d-b, 'f', -1, 64)))
			}
		} else {
			got = f.Ratio
		}
		fallthrough
	default:
		if unit != "" && unit != f.Dsec.Unit {
			return false, fmt.Errorf("check %q: unit %q, but the figure is in %q", f.Target.Check, unit, f.Dsec.Unit)
		}
		if sign == "" {
			got = f.Dsec.Values
		}
	}
	if len(got) == 0 {
		return false, fmt.Errorf("check %q: nothing to check", f.Target.Check)
	}
	v := median(got)
	switch op {
	case "<=":
		return v <= want, nil
	case ">=":
		return v >= want, nil
	case "<":
		return v < want, nil
	default:
		return v > want, nil
	}
}

func median(ns []Num) float64 {
	v := make([]float64, len(ns))
	for i, n := range ns {
		v[i], _ = n.Float64()
	}
	sort.Float64s(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

// Markers around the table in BENCHMARKS.md.
const (
	Begin = "<!-- bench-table:begin: make bench-table renders this table from bench/results.json; do not edit it by hand -->"
	End   = "<!-- bench-table:end -->"
)

// Render is the table, with its markers.
func (r *Results) Render() string {
	var areas []string
	byArea := map[string][]*Figure{}
	var machines []string
	for _, f := range r.Figures {
		if _, ok := byArea[f.Area]; !ok {
			areas = append(areas, f.Area)
		}
		byArea[f.Area] = append(byArea[f.Area], f)
		if !slices.Contains(machines, f.Machine) {
			machines = append(machines, f.Machine)
		}
	}
	var b strings.Builder
	b.WriteString(Begin + "\n")
	b.WriteString("| area | figure | dsec | baseline | ratio | target | met | command | machine | date |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|\n")
	for _, a := range areas {
		for i, f := range byArea[a] {
			area := ""
			if i == 0 {
				area = "[" + a + "](#" + Anchor(a) + ")"
			}
			target, met := "", ""
			if f.Target != nil {
				target = f.Target.Text
			}
			if f.Met != nil {
				met = "met"
				if !*f.Met {
					met = "**not met**"
				}
			}
			cells := []string{area, f.Title, f.Dsec.cell(), f.Baseline.cell(), f.ratioCell(), target, met,
				"`" + f.Command + "`", "M" + strconv.Itoa(slices.Index(machines, f.Machine)+1), f.Date}
			for i, c := range cells {
				cells[i] = strings.ReplaceAll(strings.ReplaceAll(c, "\n", " "), "|", `\|`)
			}
			b.WriteString("| " + strings.Join(cells, " | ") + " |\n")
		}
	}
	b.WriteString("\nSeveral values in a cell are runs of the same command, in order; a target is checked on their median.\n")
	b.WriteString("Machines:\n\n")
	for i, m := range machines {
		fmt.Fprintf(&b, "- M%d: %s\n", i+1, m)
	}
	b.WriteString(End + "\n")
	return b.String()
}

func (s *Side) cell() string {
	if s == nil {
		return ""
	}
	v := values(s.Values, s.Unit)
	switch {
	case s.What == "":
		return v
	case v == "":
		return s.What
	}
	return s.What + ": " + v
}

func (f *Figure) ratioCell() string {
	if len(f.Ratio) == 0 {
		return ""
	}
	switch f.RatioOf {
	case Difference:
		s := make([]string, len(f.Ratio))
		for i, n := range f.Ratio {
			s[i] = string(n)
			if !strings.HasPrefix(s[i], "-") {
				s[i] = "+" + s[i]
			}
		}
		return strings.Join(s, " / ") + " " + f.Dsec.Unit
	case RatioBaseline:
		return values(f.Ratio, "x") + " (baseline/dsec)"
	}
	return values(f.Ratio, "x")
}

func values(ns []Num, unit string) string {
	if len(ns) == 0 {
		return ""
	}
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = string(n)
	}
	out := strings.Join(s, " / ")
	switch unit {
	case "":
	case "x", "%":
		out += unit
	default:
		out += " " + unit
	}
	return out
}

// Anchor is the anchor GitHub gives a heading.
func Anchor(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r > 127:
			b.WriteRune(r)
		}
	}
	return b.String()
}

// Splice puts table between the markers of doc.
func Splice(doc, table string) (string, error) {
	i := strings.Index(doc, Begin)
	j := strings.Index(doc, End)
	if i < 0 || j < i {
		return "", fmt.Errorf("no %q ... %q in the document", Begin, End)
	}
	rest := strings.TrimPrefix(doc[j+len(End):], "\n")
	return doc[:i] + table + rest, nil
}

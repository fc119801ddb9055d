// Package grade holds what a grading fork decides about an agent's
// changes: which it carries into the grader's sandbox (Rules) and how
// each one it leaves out is reported (Classify).
package grade

import (
	"fmt"
	"path"
	"slices"
	"strings"

	"github.com/containerd/errdefs"
)

// Verdict is what a grade does with one path the agent changed.
type Verdict int

const (
	// Leave: not carried; the grader sees the pristine path.
	Leave Verdict = iota
	// Carry: carried into the grader's sandbox as the agent left it.
	Carry
	// Through: a directory a carried path lies below: kept as the
	// pristine layers have it, so that its carried descendants are.
	Through
	// Never: what the carry rules take but no grade carries (an
	// interpreter's startup hook, stale bytecode).
	Never
)

// DefaultNever are the paths no grade carries unless the policy's
// grading section says otherwise: each runs code before or around a
// test of any repository (pytest's conftest.py and ini file, Python's
// site hooks and .pth files, bytecode that may not match its source).
var DefaultNever = []string{
	"/**/conftest.py", "/**/pytest.ini", "/**/sitecustomize.py", "/**/usercustomize.py",
	"/**/*.pth", "/**/__pycache__/**", "/**/*.pyc",
}

// maxRules bounds a rule list; maxRule one rule's length.
const (
	maxRules = 256
	maxRule  = 1024
)

// Rules are carry rules: absolute glob patterns, "!" in front of one
// that excludes. A path is carried when an include matches it and no
// exclude or never pattern does. In a pattern, "*" and "?" and [...]
// match within one path segment, "**" any number of whole segments
// (one or more below a directory: /a/** is what is under /a, not /a).
type Rules struct {
	include, exclude, never []pattern
}

type pattern []string // segments

// Parse reads carry rules and never patterns (nil never: DefaultNever).
// A rule that is not an absolute clean pattern is refused, with why.
func Parse(carry, never []string) (*Rules, error) {
	if len(carry) == 0 {
		return nil, fmt.Errorf("no carry rules: give the paths that are the agent's answer, e.g. --carry '/work/repo/**' --carry '!/work/repo/tests/**' (or the policy's grading.carry): %w", errdefs.ErrInvalidArgument)
	}
	if never == nil {
		never = DefaultNever
	}
	if len(carry) > maxRules || len(never) > maxRules {
		return nil, fmt.Errorf("more than %d carry or never rules: %w", maxRules, errdefs.ErrInvalidArgument)
	}
	r := &Rules{}
	for _, s := range carry {
		excl := strings.HasPrefix(s, "!")
		p, err := parsePattern(strings.TrimPrefix(s, "!"))
		if err != nil {
			return nil, fmt.Errorf("carry rule %q: %w", s, err)
		}
		if excl {
			r.exclude = append(r.exclude, p)
		} else {
			r.include = append(r.include, p)
		}
	}
	if len(r.include) == 0 {
		return nil, fmt.Errorf("the carry rules only exclude: give at least one path to carry, e.g. '/work/repo/**': %w", errdefs.ErrInvalidArgument)
	}
	for _, s := range never {
		p, err := parsePattern(s)
		if err != nil {
			return nil, fmt.Errorf("never rule %q: %w", s, err)
		}
		r.never = append(r.never, p)
	}
	return r, nil
}

func parsePattern(s string) (pattern, error) {
	if len(s) > maxRule {
		return nil, fmt.Errorf("longer than %d bytes: %w", maxRule, errdefs.ErrInvalidArgument)
	}
	if !strings.HasPrefix(s, "/") || s == "/" || strings.ContainsRune(s, 0) {
		return nil, fmt.Errorf("give an absolute path pattern below /, e.g. /work/repo/**: %w", errdefs.ErrInvalidArgument)
	}
	segs := strings.Split(s[1:], "/")
	for _, seg := range segs {
		switch {
		case seg == "" || seg == "." || seg == "..":
			return nil, fmt.Errorf("an empty, . or .. segment: give a clean path: %w", errdefs.ErrInvalidArgument)
		case seg != "**" && strings.Contains(seg, "**"):
			return nil, fmt.Errorf("** stands for whole segments only (/a/**/b, not /a/b**): %w", errdefs.ErrInvalidArgument)
		}
		if _, err := path.Match(seg, ""); err != nil {
			return nil, fmt.Errorf("segment %q: %v: %w", seg, err, errdefs.ErrInvalidArgument)
		}
	}
	return segs, nil
}

// Decide says what a grade does with the absolute path p (a directory:
// dir), as the agent left it.
func (r *Rules) Decide(p string, dir bool) Verdict {
	segs := split(p)
	if anyMatch(r.exclude, segs) {
		return Leave
	}
	if anyMatch(r.include, segs) {
		if anyMatch(r.never, segs) {
			return Never
		}
		return Carry
	}
	if dir && slices.ContainsFunc(r.include, func(q pattern) bool { return prefixOf(segs, q) }) {
		return Through
	}
	return Leave
}

// Guards says whether an exclude or never pattern may match a path
// below the directory p: removing p then removes what no grade carries.
func (r *Rules) Guards(p string) bool {
	segs := split(p)
	return slices.ContainsFunc(r.exclude, func(q pattern) bool { return prefixOf(segs, q) }) ||
		slices.ContainsFunc(r.never, func(q pattern) bool { return prefixOf(segs, q) })
}

// Excluded says whether an exclude rule matches p (a test, as the task
// names them).
func (r *Rules) Excluded(p string) bool { return anyMatch(r.exclude, split(p)) }

// Hook says whether a never pattern matches p.
func (r *Rules) Hook(p string) bool { return anyMatch(r.never, split(p)) }

func split(p string) []string {
	p = strings.Trim(path.Clean("/"+p), "/")
	if p == "" {
		return nil
	}
	return strings.Split(p, "/")
}

func anyMatch(ps []pattern, segs []string) bool {
	return slices.ContainsFunc(ps, func(q pattern) bool { return match(q, segs) })
}

// match says whether q matches the path segs whole.
func match(q pattern, segs []string) bool {
	for len(q) > 0 {
		if q[0] == "**" {
			rest := q[1:]
			// One segment or more: a trailing ** is what is below.
			for i := 1; i <= len(segs); i++ {
				if match(rest, segs[i:]) {
					return true
				}
			}
			return false
		}
		if len(segs) == 0 {
			return false
		}
		if ok, _ := path.Match(q[0], segs[0]); !ok {
			return false
		}
		q, segs = q[1:], segs[1:]
	}
	return len(segs) == 0
}

// prefixOf says whether the directory segs may hold a path q matches:
// segs matches a proper prefix of q, a ** matching anything below.
func prefixOf(segs []string, q pattern) bool {
	for i, s := range segs {
		if i >= len(q) {
			return false
		}
		if q[i] == "**" {
			return true
		}
		if ok, _ := path.Match(q[i], s); !ok {
			return false
		}
	}
	return len(q) > len(segs)
}

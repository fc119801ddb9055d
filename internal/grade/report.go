package grade

import (
	"path"
	"slices"
	"strings"

	"github.com/dsec-project/dsec/api"
)

// Where says what a report needs beyond the rules to group a path.
type Where struct {
	Rules *Rules
	// Path are the directories of the agent's PATH.
	Path []string
	// Toolkit says whether the grader's layers hold p.
	Toolkit func(p string) bool
	// Guarded are the policy's hidden and read-only paths.
	Guarded []string
	// Result is the grader's result file.
	Result string
}

// DefaultPath is an exec's PATH when the sandbox gives none.
var DefaultPath = []string{"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"}

// testNames are what test runners collect, whatever the task's rules.
var testNames = []string{"test_*.py", "*_test.py", "*_test.go", "*.test.js", "*.spec.js", "*.test.ts", "*.spec.ts"}

// Group is the group of the report a change the grade left out of p
// falls in (api.Tamper*), the first that holds: the result file, pseudo paths, startup
// hooks, tests, the toolkit's files, guarded paths, commands on PATH,
// the rest.
func (w Where) Group(p string) string {
	p = path.Clean("/" + p)
	base := path.Base(p)
	switch {
	case w.Result != "" && p == path.Clean(w.Result):
		return api.TamperResult
	case under(p, "/proc", "/sys", "/dev"):
		return api.TamperPseudo
	case w.Rules.Hook(p) || slices.Contains([]string{"sitecustomize.py", "usercustomize.py", "conftest.py"}, base) || strings.HasSuffix(base, ".pth"):
		return api.TamperHooks
	case w.Rules.Excluded(p) || slices.ContainsFunc(strings.Split(p, "/"), func(s string) bool { return s == "tests" || s == "test" }) ||
		slices.ContainsFunc(testNames, func(n string) bool { ok, _ := path.Match(n, base); return ok }):
		return api.TamperTests
	case w.Toolkit != nil && w.Toolkit(p):
		return api.TamperToolkit
	case under(p, w.Guarded...):
		return api.TamperGuarded
	case slices.Contains(w.Path, path.Dir(p)) || slices.Contains(DefaultPath, path.Dir(p)):
		return api.TamperOnPath
	}
	return api.TamperOther
}

// under says whether p is one of dirs or below one.
func under(p string, dirs ...string) bool {
	return slices.ContainsFunc(dirs, func(d string) bool {
		d = path.Clean("/" + d)
		return p == d || strings.HasPrefix(p, strings.TrimSuffix(d, "/")+"/")
	})
}

// PathOf is the directories of PATH in env (KEY=VALUE; the last wins),
// nil without one.
func PathOf(env []string) []string {
	var dirs []string
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			dirs = nil
			for _, d := range strings.Split(v, ":") {
				if strings.HasPrefix(d, "/") {
					dirs = append(dirs, path.Clean(d))
				}
			}
		}
	}
	return dirs
}

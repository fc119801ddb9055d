package grade

import (
	"strings"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
)

func TestDecide(t *testing.T) {
	r, err := Parse([]string{"/work/repo/**", "!/work/repo/tests/**", "/etc/app.conf", "/data/*.csv"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		path string
		dir  bool
		want Verdict
	}{
		{"/work/repo/src/a.py", false, Carry},
		{"/work/repo/src", true, Carry},
		{"/work/repo", true, Through}, // ** is what is below
		{"/work", true, Through},
		{"/work", false, Leave}, // a file where the way goes: not carried
		{"/", true, Through},
		{"/work/repo/tests/test_a.py", false, Leave},
		{"/work/repo/tests/sub/x", false, Leave},
		{"/work/repo/tests", true, Carry}, // itself: the excluded are below
		{"/work/repo/conftest.py", false, Never},
		{"/work/repo/src/conftest.py", false, Never},
		{"/work/repo/x.pth", false, Never},
		{"/work/repo/src/__pycache__/a.pyc", false, Never},
		{"/work/repo/src/__pycache__", true, Carry},
		{"/work/repository/a", false, Leave},
		{"/etc/app.conf", false, Carry},
		{"/etc", true, Through},
		{"/etc/passwd", false, Leave},
		{"/data/a.csv", false, Carry},
		{"/data/sub/a.csv", false, Leave},
		{"/usr/bin/pytest", false, Leave},
		{"/work/repo/../../usr/bin/x", false, Leave}, // cleaned first
	} {
		if got := r.Decide(c.path, c.dir); got != c.want {
			t.Errorf("Decide(%q, dir %v) = %v, want %v", c.path, c.dir, got, c.want)
		}
	}
	if !r.Guards("/work/repo") || !r.Guards("/work/repo/src") {
		t.Error("Guards: /work/repo holds tests and hooks")
	}
	none, err := Parse([]string{"/data/*.csv"}, []string{})
	if err != nil {
		t.Fatal(err)
	}
	if none.Guards("/data") || none.Decide("/data/conftest.csv", false) != Carry {
		t.Error("an empty never list carries what it would not")
	}
}

func TestParseRefuses(t *testing.T) {
	for _, c := range []struct {
		carry, never []string
		want         string
	}{
		{nil, nil, "no carry rules"},
		{[]string{"work/**"}, nil, "absolute"},
		{[]string{"/"}, nil, "absolute"},
		{[]string{"/a//b"}, nil, "clean"},
		{[]string{"/a/../b"}, nil, "clean"},
		{[]string{"/a/b**"}, nil, "whole segments"},
		{[]string{"/a/[b"}, nil, "syntax"},
		{[]string{"!/a/**"}, nil, "only exclude"},
		{[]string{"/a/**"}, []string{"x"}, "never rule"},
		{[]string{"/" + strings.Repeat("a", 2000)}, nil, "longer"},
		{make([]string, 300), nil, "more than"},
	} {
		_, err := Parse(c.carry, c.never)
		if err == nil || !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Parse(%q, %q) = %v, want an invalid argument saying %q", c.carry, c.never, err, c.want)
		}
	}
}

func TestGroup(t *testing.T) {
	r, _ := Parse([]string{"/work/repo/**", "!/work/repo/checks/**"}, nil)
	w := Where{Rules: r, Path: []string{"/opt/tools/bin"}, Guarded: []string{"/secret"}, Result: "/tmp/r.json",
		Toolkit: func(p string) bool { return strings.HasPrefix(p, "/opt/grader/") }}
	for p, want := range map[string]string{
		"/proc/self/x":                          api.TamperPseudo,
		"/dev/shm/x":                            api.TamperPseudo,
		"/usr/lib/python3/dist-packages/zz.pth": api.TamperHooks,
		"/usr/lib/python3.11/sitecustomize.py":  api.TamperHooks,
		"/work/repo/conftest.py":                api.TamperHooks,
		"/work/repo/checks/run.sh":              api.TamperTests, // the task's exclude
		"/work/other/tests/a.py":                api.TamperTests,
		"/work/other/test_a.py":                 api.TamperTests,
		"/opt/grader/grade":                     api.TamperToolkit,
		"/secret/answer":                        api.TamperGuarded,
		"/usr/local/bin/pytest":                 api.TamperOnPath,
		"/opt/tools/bin/python":                 api.TamperOnPath,
		"/tmp/x":                                api.TamperOther,
		"/tmp/r.json":                           api.TamperResult,
		"/root/.bash_history":                   api.TamperOther,
	} {
		if got := w.Group(p); got != want {
			t.Errorf("Group(%s) = %s, want %s", p, got, want)
		}
	}
	if got := PathOf([]string{"PATH=/a:/b", "X=1", "PATH=/c:relative:/d/"}); strings.Join(got, ",") != "/c,/d" {
		t.Errorf("PathOf: %v", got)
	}
}

// FuzzRules: carry rules are a tenant's input; none makes Parse or a
// decision panic, and a path an exclude matches is never carried.
func FuzzRules(f *testing.F) {
	f.Add("/work/repo/**", "!/work/repo/tests/**", "/work/repo/tests/a.py")
	f.Add("/a/*/b/**/c", "/x/[a-z]?", "/a/q/b/r/s/c")
	f.Add("/**", "!/**/secret", "/etc/secret")
	f.Fuzz(func(t *testing.T, a, b, p string) {
		r, err := Parse([]string{a, b}, nil)
		if err != nil {
			return
		}
		for _, dir := range []bool{false, true} {
			v := r.Decide(p, dir)
			if r.Excluded(p) && v != Leave {
				t.Fatalf("Decide(%q) = %v for an excluded path (rules %q %q)", p, v, a, b)
			}
		}
		r.Guards(p)
	})
}

package tenant

import (
	"strings"
	"testing"

	"github.com/containerd/errdefs"
)

func TestNamespace(t *testing.T) {
	ns := Of("0123456789ab")
	other := Of("ba9876543210")
	for _, c := range []struct {
		ref, tag string
		ok       bool
	}{
		{"x:1", "tenants/0123456789ab/x:1", true},
		{"team/run-7:12", "tenants/0123456789ab/team/run-7:12", true},
		{"tenants/0123456789ab/x:1", "tenants/0123456789ab/x:1", true},
		{"tenants/ba9876543210/x:1", "", false},
		{"tenants/x:1", "", false},
	} {
		tag, err := ns.Tag(c.ref)
		if tag != c.tag || (err == nil) != c.ok || err != nil && !errdefs.IsInvalidArgument(err) {
			t.Errorf("Tag(%q) = %q, %v", c.ref, tag, err)
		}
		if c.ok && ns.Show(tag) != strings.TrimPrefix(c.ref, string(ns)) {
			t.Errorf("Show(%q) = %q", tag, ns.Show(tag))
		}
	}
	// Another tenant's tag refused says nothing of whether it exists:
	// the answer is the ref's alone.
	_, e1 := ns.Tag("tenants/ba9876543210/x:1")
	_, e2 := ns.Tag("tenants/ba9876543210/y:1")
	if strings.ReplaceAll(e1.Error(), "x:1", "y:1") != e2.Error() {
		t.Errorf("%v / %v", e1, e2)
	}
	if ns.Owns("tenants/ba9876543210/x:1") || !other.Owns("tenants/ba9876543210/x:1") || Namespace("").Owns("x:1") {
		t.Error("Owns")
	}
	if ns.Show("debian:12") != "debian:12" || !Reserved("tenants/a/b:1") || Reserved("tenantsx/a:1") || Reserved("debian:12") {
		t.Error("Show or Reserved")
	}
}

// FuzzTag: whatever ref a tenant sends, the tag it gets is in its own
// namespace, and Show gives back what it named.
func FuzzTag(f *testing.F) {
	for _, s := range []string{"x:1", "tenants/0123456789ab/x:1", "tenants/other/x:1", "", "tenants/", "../x"} {
		f.Add(s)
	}
	ns := Of("0123456789ab")
	f.Fuzz(func(t *testing.T, ref string) {
		tag, err := ns.Tag(ref)
		if err != nil {
			return
		}
		if !ns.Owns(tag) || Of("ba9876543210").Owns(tag) {
			t.Fatalf("%q -> %q", ref, tag)
		}
		if got := ns.Show(tag); string(ns)+got != tag {
			t.Fatalf("%q -> %q -> %q", ref, tag, got)
		}
	})
}

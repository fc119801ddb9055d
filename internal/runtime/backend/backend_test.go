package backend_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/runtime/backend"
)

type fake struct {
	name string
	err  error
}

func (f fake) Name() string     { return f.name }
func (f fake) Available() error { return f.err }

func TestRegistry(t *testing.T) {
	missing := fmt.Errorf("no /dev/kvm: %w", errdefs.ErrNotImplemented)
	r := backend.NewRegistry(fake{"container", nil}, fake{"microvm", missing})
	if got := r.Names(); !slices.Equal(got, []string{"container", "microvm"}) {
		t.Fatalf("names %v", got)
	}
	for name, want := range map[string]string{"": "container", "container": "container", "microvm": "microvm"} {
		if b, err := r.Lookup(name); err != nil || b.Name() != want {
			t.Errorf("Lookup(%q): %v, %v; want %s", name, b, err, want)
		}
	}
	_, err := r.Lookup("warp")
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), `unknown backend "warp": this worker runs container, microvm`) {
		t.Errorf("an unknown backend: %v", err)
	}
	if _, err := r.Usable("microvm"); !errdefs.IsNotImplemented(err) || !errors.Is(err, missing) || !strings.Contains(err.Error(), "backend microvm cannot run on this host: no /dev/kvm") {
		t.Errorf("a backend this host cannot run: %v", err)
	}
	if b, err := r.Usable(""); err != nil || b.Name() != "container" {
		t.Errorf("the default: %v, %v", b, err)
	}
	for _, bad := range [][]backend.Backend{{fake{"", nil}}, {fake{"a", nil}, fake{"a", nil}}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("registered %v", bad)
				}
			}()
			backend.NewRegistry(bad...)
		}()
	}
}

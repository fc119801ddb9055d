package feature

import (
	"errors"
	"testing"

	"github.com/containerd/errdefs"
)

func TestMemoised(t *testing.T) {
	calls := 0
	missing := New("x.y", "does without", func() error { calls++; return errors.New("no x") })
	for range 3 {
		if missing.Have() {
			t.Fatal("a failing probe: have")
		}
	}
	err := missing.Err()
	var u *UnsupportedError
	if calls != 1 || !errors.Is(err, errdefs.ErrNotImplemented) || !errors.As(err, &u) || u.Reason != "no x" || u.Without != "does without" {
		t.Fatalf("%d probes, %v", calls, err)
	}
	if err.Error() != "this host lacks x.y: no x" {
		t.Fatalf("message %q", err)
	}
	if !New("z", "", func() error { return nil }).Have() {
		t.Fatal("a passing probe: not had")
	}
}

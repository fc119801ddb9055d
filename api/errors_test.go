package api

import (
	"errors"
	"fmt"
	"net/http"
	"testing"

	"github.com/containerd/errdefs"
)

// TestErrorTable: every class goes from an errdefs error to its class
// and status and back to the same errdefs error, whatever wraps it; a
// status alone (a proxy's answer) gives the class where it is the
// class's own; an error of no class is internal.
func TestErrorTable(t *testing.T) {
	seen := map[int]int{}
	for _, r := range errorTable {
		seen[r.status]++
	}
	for _, r := range errorTable {
		e, status := ErrorOf(fmt.Errorf("outer: %w", fmt.Errorf("inner: %w", r.err)))
		if e.Class != r.class || status != r.status || e.Message != "outer: inner: "+r.err.Error() {
			t.Errorf("%v: class %q, status %d, message %q", r.err, e.Class, status, e.Message)
		}
		if !errors.Is(e, r.err) {
			t.Errorf("class %s unwraps to %v, want %v", r.class, e.Unwrap(), r.err)
		}
		if want := r.class; seen[r.status] > 1 || r.status == http.StatusInternalServerError {
			if got := ClassOfStatus(r.status); got != ClassInternal {
				t.Errorf("status %d (shared) gives class %q, want internal", r.status, got)
			}
		} else if got := ClassOfStatus(r.status); got != want {
			t.Errorf("status %d gives class %q, want %q", r.status, got, want)
		}
	}
	if e, status := ErrorOf(errors.New("boom")); e.Class != ClassInternal || status != 500 || e.Unwrap() != nil {
		t.Errorf("an error of no class: %+v, %d", e, status)
	}
	// PermissionDenied (a registry refusing credentials) was missing
	// from the worker's mapping: it came out internal, exit 1, not 7.
	if e, status := ErrorOf(errdefs.ErrPermissionDenied); e.Class != ClassDenied || status != http.StatusForbidden {
		t.Errorf("permission denied: %+v, %d", e, status)
	}
}

// TestErrorTableStatuses: the table's statuses, numbers there so that
// the package does not import net/http, are net/http's for each class.
func TestErrorTableStatuses(t *testing.T) {
	want := map[string]int{
		ClassLimit:          http.StatusRequestEntityTooLarge,
		ClassInvalid:        http.StatusBadRequest,
		ClassNotFound:       http.StatusNotFound,
		ClassExists:         http.StatusConflict,
		ClassState:          http.StatusPreconditionFailed,
		ClassInfra:          http.StatusServiceUnavailable,
		ClassBusy:           http.StatusTooManyRequests,
		ClassDenied:         http.StatusForbidden,
		ClassUnauthorized:   http.StatusUnauthorized,
		ClassNotImplemented: http.StatusNotImplemented,
		ClassDataLoss:       http.StatusInternalServerError,
	}
	if len(errorTable) != len(want) {
		t.Fatalf("the table has %d classes, this test %d: name the new one's status here", len(errorTable), len(want))
	}
	for _, r := range errorTable {
		if r.status != want[r.class] {
			t.Errorf("class %s: status %d, want %d (%s)", r.class, r.status, want[r.class], http.StatusText(want[r.class]))
		}
	}
	if statusInternal != http.StatusInternalServerError {
		t.Errorf("statusInternal %d", statusInternal)
	}
}

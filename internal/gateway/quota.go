package gateway

import (
	"cmp"
	"fmt"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/auth"
)

// quotaOn is t as worker n is to see it: its quota less what its
// sandboxes hold on the other workers, as their lists say, so that n's
// check holds the quota across the fleet (to within the creates in
// flight to other workers meanwhile). A bound they fill is -1 (none
// left: n refuses whatever would add to it), with an error that says
// so.
func (g *Gateway) quotaOn(t *auth.Token, n *node) (*auth.Token, error) {
	q := t.Quota
	if t.Scope == auth.Admin || q.Sandboxes == 0 && q.Memory == 0 && q.Disk == 0 {
		return t, nil
	}
	var count, mem, disk int64
	for _, o := range g.all() {
		if o == n {
			continue
		}
		o.mu.Lock()
		for _, s := range o.held { // (a worker down's too: they still stand)
			if s.Owner == t.ID {
				count, mem, disk = count+1, mem+s.Memory, disk+cmp.Or(s.DiskLimit, s.Disk)
			}
		}
		o.mu.Unlock()
	}
	left := *t
	var err error
	for _, b := range []struct {
		what        string
		bound, have int64
		left        func(int64)
	}{
		{"sandboxes", int64(q.Sandboxes), count, func(v int64) { left.Quota.Sandboxes = int(v) }},
		{"bytes of memory limits", q.Memory, mem, func(v int64) { left.Quota.Memory = v }},
		{"bytes of disk bounds", q.Disk, disk, func(v int64) { left.Quota.Disk = v }},
	} {
		switch {
		case b.bound == 0:
		case b.have >= b.bound:
			b.left(-1)
			err = cmp.Or(err, fmt.Errorf("token %s's quota: its sandboxes on the fleet hold %d %s, its bound: remove some of them first (dsec rm): %w",
				t.ID, b.have, b.what, errdefs.ErrResourceExhausted))
		default:
			b.left(b.bound - b.have)
		}
	}
	return &left, err
}

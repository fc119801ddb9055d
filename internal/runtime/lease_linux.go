package runtime

import (
	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer/store"
)

// createLease starts the lease of a create on s (store leases): what it
// resolves stays in use until its state names it. nil s (library use
// without a store): none.
func createLease(s *store.Store) (*store.Lease, error) {
	if s == nil {
		return nil, nil
	}
	return s.Lease("create-" + RandomName(""))
}

// leased runs resolve, which resolves refs to the digests it returns
// (what it resolved before a failure too), and adds them to lease, both
// under the store's writer lock: a collection waits for them, so none
// takes what was resolved before the lease names it. nil lease: resolve
// alone.
func leased(s *store.Store, lease *store.Lease, resolve func() ([]string, error)) error {
	if s == nil || lease == nil {
		_, err := resolve()
		return err
	}
	unlock, err := s.Writer()
	if err != nil {
		return err
	}
	defer unlock()
	ds, err := resolve()
	var add []digest.Digest
	for _, d := range ds {
		if d != "" {
			add = append(add, digest.Digest(d))
		}
	}
	if aerr := lease.Add(add...); err == nil {
		err = aerr
	}
	return err
}

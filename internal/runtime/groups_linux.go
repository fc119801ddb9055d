package runtime

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"

	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/driver"
)

// Groups names the groups in t of root's sandboxes that an older dsec
// did not make, and of its spares, waiting or taken: named by an ID.
func Groups(t *cgroup.Tree, root string) ([]string, error) {
	return t.List("sb-"+driver.IDTag, CgroupSuffix(root))
}

// CgroupSuffix ends the name of every group of root's sandboxes.
func CgroupSuffix(root string) string { return driver.GroupSuffix(root) }

// SweepSpares removes the groups named by an ID that a worker of h's root
// left when it died (its spares exit when it does; their groups stay;
// and a sandbox's, a worker died making), but for those keep names, the
// groups of the sandboxes kept. With spareLive a group that still holds
// processes is left alone: a worker that could not read every sandbox's
// state does not know all it keeps.
func (h *Host) SweepSpares(keep []string, spareLive bool) error {
	t := h.Groups()
	names, err := Groups(t, h.Root)
	if err != nil {
		return err
	}
	var errs []error
	for _, name := range names {
		if slices.Contains(keep, name) {
			continue
		}
		g, err := t.Open(name)
		if err != nil { // only v1 directories left (an older worker's Remove)
			if err := t.RemoveLeftover(name); err != nil {
				errs = append(errs, fmt.Errorf("group %s: %w", filepath.Base(name), err))
			}
			continue
		}
		if pids, _ := g.Pids(); spareLive && len(pids) > 0 {
			continue
		}
		if err := errors.Join(g.Kill(), g.Remove()); err != nil {
			errs = append(errs, fmt.Errorf("group %s: %w", filepath.Base(name), err))
		}
	}
	return errors.Join(errs...)
}

package runtime

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/driver"
)

// A sandbox's identity. Every sandbox has an ID, chosen when it is made
// and never changed: it names the sandbox's directory
// (<root>/sandboxes/ID), its cgroup (cgroupName) and the user its layers
// are held by (package lower). An ID is '_' and 12 random hex digits, a
// form no name has. The name is a label: a symbolic link
// <root>/names/NAME to ../sandboxes/ID, made in one step (of two creates
// of one name, one wins) once the sandbox's first state is written, and
// removed last. A primed sandbox has no name until a create takes it,
// which then only writes its state and its name; a sandbox no name
// points at (primed, a call's, one a worker died making before it was
// named) is removed by the next worker (SweepUnnamed).
//
// A sandbox an older dsec made lives in <root>/sandboxes/NAME, without
// an ID in its state: its ID is its name, and no link names it.

// idTag starts every ID: no name starts with it.
const idTag = driver.IDTag

// newID is a new sandbox ID.
func newID() string { return driver.NewID() }

func sandboxDir(root, id string) string { return filepath.Join(root, "sandboxes", id) }

func nameLink(root, name string) string { return filepath.Join(root, "names", name) }

// errExists says a name is taken.
func errExists(name string) error {
	return fmt.Errorf("sandbox %s already exists: give another --name, or remove it first (dsec rm): %w", name, errdefs.ErrAlreadyExists)
}

// nameFree says whether name names no sandbox yet: a cheap look before
// a create does any work (claimName decides).
func nameFree(root, name string) error {
	for _, p := range []string{nameLink(root, name), sandboxDir(root, name)} {
		if _, err := os.Lstat(p); err == nil {
			return errExists(name)
		}
	}
	return nil
}

// claimName names the sandbox id: it fails, taken, if another sandbox
// has the name. Call it after nameFree (an older dsec's sandboxes/NAME,
// which no dsec makes any more, is looked for there).
func claimName(root, name, id string) error {
	target, link := filepath.Join("..", "sandboxes", id), nameLink(root, name)
	err := os.Symlink(target, link)
	if errors.Is(err, os.ErrNotExist) { // the root's first name
		if err = os.MkdirAll(filepath.Join(root, "names"), 0o700); err == nil {
			err = os.Symlink(target, link)
		}
	}
	if errors.Is(err, os.ErrExist) {
		return errExists(name)
	}
	return err
}

// dropName removes name if it still names id.
func dropName(root, name, id string) error {
	l := nameLink(root, name)
	if target, err := os.Readlink(l); err != nil || filepath.Base(target) != id {
		return nil
	}
	if err := os.Remove(l); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// IDOf is the ID of the sandbox name names ("" when none does).
func IDOf(root, name string) string {
	if target, err := os.Readlink(nameLink(root, name)); err == nil {
		return filepath.Base(target)
	}
	if fi, err := os.Lstat(sandboxDir(root, name)); err == nil && fi.IsDir() {
		return name // an older dsec's
	}
	return ""
}

// List names the sandboxes under root. It changes nothing.
func List(root string) ([]string, error) {
	var names []string
	for _, d := range []string{"names", "sandboxes"} { // "sandboxes": an older dsec's
		ents, err := os.ReadDir(filepath.Join(root, d))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, e := range ents {
			if api.ValidName(e.Name()) == nil {
				names = append(names, e.Name())
			}
		}
	}
	return names, nil
}

// Unnamed lists the IDs of root's sandboxes no name points at: a
// running worker's primed ones and calls' (run --rm), or what a dead
// worker left.
func Unnamed(root string) []string {
	named := map[string]bool{}
	links, _ := os.ReadDir(filepath.Join(root, "names"))
	for _, l := range links {
		named[IDOf(root, l.Name())] = true
	}
	var out []string
	dirs, _ := os.ReadDir(filepath.Join(root, "sandboxes"))
	for _, d := range dirs {
		if id := d.Name(); !named[id] && api.ValidName(id) != nil { // a valid name: an older dsec's
			out = append(out, id)
		}
	}
	return out
}

// SweepUnnamed removes the sandboxes of root no name points at (they
// outlive their worker, as every sandbox does), and the names whose
// sandbox is gone (a worker died removing it). Call it with the root's
// worker lock held, after the named sandboxes are loaded and before
// lower.Sweep and SweepSpares.
func (h *Host) SweepUnnamed() error {
	h.init()
	root := h.Root
	var errs []error
	links, _ := os.ReadDir(filepath.Join(root, "names"))
	for _, l := range links {
		if _, err := os.Stat(nameLink(root, l.Name())); errors.Is(err, os.ErrNotExist) {
			if err := os.Remove(nameLink(root, l.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for _, id := range Unnamed(root) {
		if err := unloaded(h, id).teardown(true); err != nil {
			errs = append(errs, fmt.Errorf("sandbox %s: %w", id, err))
		}
	}
	return errors.Join(errs...)
}

// unloaded is the sandbox in root's directory id as its state says, or
// as its ID alone says where it has none: enough to tear it down (by
// its backend's driver on h; none found: nothing of it is).
func unloaded(h *Host, id string) *Sandbox {
	root := h.Root
	sb := &Sandbox{dir: sandboxDir(root, id), host: h}
	if b, err := os.ReadFile(filepath.Join(sb.dir, "state.json")); err == nil {
		json.Unmarshal(b, &sb.State)
	}
	sb.ID = id
	if sb.CgroupName == "" {
		sb.CgroupName = cgroupName(root, id)
	}
	sb.d, _ = h.Drivers.Driver(sb.Backend)
	return sb
}

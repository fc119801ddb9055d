package microvm

import (
	"bytes"
	"debug/elf"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/containerd/errdefs"
)

// GuestModules are the modules the guest loads (with what they depend
// on): its devices (virtio over PCI, the agent's serial port, pmem for
// the layers, a disk for the upper, a NIC, the balloon, entropy) and its
// file systems (EROFS with DAX, overlay, ext4 for the upper).
// crc32c_generic is ext4's soft dependency (crypto-crc32c), which names
// an alias, not a module: listed here, it loads before ext4.
var GuestModules = []string{
	"virtio_pci", "virtio_console", "virtio_blk", "nd_pmem", "virtio_pmem", "virtio_net", "virtio_balloon", "virtio-rng",
	"crc32c_generic", "erofs", "overlay", "ext4",
}

// modName is a module's name as the kernel compares them: '-' and '_'
// are the same.
func modName(s string) string { return strings.ReplaceAll(s, "-", "_") }

// modInfo is what a module's .modinfo section says of it that loading
// needs: the modules it depends on.
type modInfo struct {
	name    string
	depends []string
}

// parseModinfo reads a .modinfo section: NUL-separated key=value
// strings. It is a kernel package's bytes, read as untrusted: a name or
// dependency that could not be a module's is an error.
func parseModinfo(b []byte) (modInfo, error) {
	var m modInfo
	for _, kv := range bytes.Split(b, []byte{0}) {
		k, v, ok := bytes.Cut(kv, []byte{'='})
		if !ok {
			continue
		}
		switch string(k) {
		case "name":
			if !validModName(string(v)) {
				return m, fmt.Errorf("module name %q", v)
			}
			m.name = modName(string(v))
		case "depends":
			for _, d := range strings.Split(string(v), ",") {
				if d == "" {
					continue
				}
				if !validModName(d) {
					return m, fmt.Errorf("dependency %q", d)
				}
				m.depends = append(m.depends, modName(d))
			}
		}
	}
	return m, nil
}

func validModName(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// readModinfo reads the .modinfo section of the module file p.
func readModinfo(p string) (modInfo, error) {
	f, err := elf.Open(p)
	if err != nil {
		return modInfo{}, err
	}
	defer f.Close()
	s := f.Section(".modinfo")
	if s == nil {
		return modInfo{}, fmt.Errorf("%s: no .modinfo section", p)
	}
	b, err := s.Data()
	if err != nil {
		return modInfo{}, err
	}
	m, err := parseModinfo(b)
	if err != nil {
		return m, fmt.Errorf("%s: %w", p, err)
	}
	return m, nil
}

// ResolveModules finds the modules named (and those they depend on,
// from each module's depends=) under dir, and returns their files in an
// order they load in: every module after those it depends on. A module
// the kernel builds in has no file: naming it is no error, since
// nothing needs loading; a dependency with no file is (the kernel would
// refuse the module).
func ResolveModules(dir string, names []string) ([]string, error) {
	files := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".ko") {
			files[modName(strings.TrimSuffix(d.Name(), ".ko"))] = p
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	builtin := map[string]bool{}
	if b, err := os.ReadFile(filepath.Join(dir, "modules.builtin")); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			builtin[modName(strings.TrimSuffix(filepath.Base(l), ".ko"))] = true
		}
	}
	var order []string
	state := map[string]int{} // 1: being visited, 2: done
	var visit func(name string, from string) error
	visit = func(name, from string) error {
		switch state[name] {
		case 1:
			return fmt.Errorf("module %s depends on itself (through %s)", name, from)
		case 2:
			return nil
		}
		p, ok := files[name]
		if !ok {
			if builtin[name] || from == "" {
				state[name] = 2
				return nil
			}
			return fmt.Errorf("module %s (which %s depends on) is not in %s: %w", name, from, dir, errdefs.ErrNotFound)
		}
		state[name] = 1
		m, err := readModinfo(p)
		if err != nil {
			return err
		}
		for _, d := range m.depends {
			if err := visit(d, name); err != nil {
				return err
			}
		}
		state[name] = 2
		order = append(order, p)
		return nil
	}
	for _, n := range names {
		n = modName(n)
		if _, ok := files[n]; !ok && !builtin[n] {
			return nil, fmt.Errorf("the guest kernel in %s has no module %s: %w", dir, n, errdefs.ErrNotFound)
		}
		if err := visit(n, ""); err != nil {
			return nil, err
		}
	}
	return order, nil
}

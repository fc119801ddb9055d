package erofs

import (
	"encoding/binary"
	"fmt"
	"sort"
	"strings"
)

var xattrPrefixes = []struct {
	prefix string
	index  uint8
	whole  bool // the name is the prefix itself
}{
	{"user.", 1, false},
	{"system.posix_acl_access", 2, true},
	{"system.posix_acl_default", 3, true},
	{"trusted.", 4, false},
	{"security.", 6, false},
}

type xattrKey struct {
	index uint8
	name  string
}

func splitXattr(name string) (xattrKey, bool) {
	for _, p := range xattrPrefixes {
		if p.whole && name == p.prefix {
			return xattrKey{p.index, ""}, true
		}
		if !p.whole && strings.HasPrefix(name, p.prefix) && len(name) > len(p.prefix) {
			return xattrKey{p.index, name[len(p.prefix):]}, true
		}
	}
	return xattrKey{}, false
}

func checkAttr(p string, a *Attr) error {
	for name, v := range a.Xattrs {
		k, ok := splitXattr(name)
		if !ok {
			return fmt.Errorf("%w: %q: xattr %q is outside the user., trusted., security. and system.posix_acl_* namespaces", ErrInvalid, p, name)
		}
		if len(k.name) > 255 {
			return fmt.Errorf("%w: %q: xattr name %q is longer than 255 bytes", ErrInvalid, p, name)
		}
		if len(v) > 0xFFFF {
			return fmt.Errorf("%w: %q: xattr %q value of %d bytes exceeds 65535", ErrInvalid, p, name, len(v))
		}
	}
	if t := a.Mode & S_IFMT; t != S_IFCHR && t != S_IFBLK {
		a.Rdev = 0
	}
	return nil
}

func encodeXattrs(m map[string][]byte) []byte {
	if len(m) == 0 {
		return nil
	}
	type kv struct {
		k xattrKey
		v []byte
	}
	list := make([]kv, 0, len(m))
	for name, v := range m {
		k, _ := splitXattr(name)
		list = append(list, kv{k, v})
	}
	sort.Slice(list, func(i, j int) bool {
		if list[i].k.index != list[j].k.index {
			return list[i].k.index < list[j].k.index
		}
		return list[i].k.name < list[j].k.name
	})
	out := make([]byte, xattrHeaderSize)
	for _, e := range list {
		var h [4]byte
		h[0] = uint8(len(e.k.name))
		h[1] = e.k.index
		binary.LittleEndian.PutUint16(h[2:], uint16(len(e.v)))
		out = append(out, h[:]...)
		out = append(out, e.k.name...)
		out = append(out, e.v...)
		for len(out)%4 != 0 {
			out = append(out, 0)
		}
	}
	return out
}

// SetXattr sets one xattr on an existing entry.
func (w *Writer) SetXattr(p, name string, value []byte) error {
	n, err := w.find(p)
	if err != nil {
		return err
	}
	if n == nil {
		return fmt.Errorf("%w: setxattr %q: no such entry", ErrInvalid, p)
	}
	a := n.ino.Attr
	x := make(map[string][]byte, len(a.Xattrs)+1)
	for k, v := range a.Xattrs {
		x[k] = v
	}
	x[name] = value
	a.Xattrs = x
	if err := checkAttr(p, &a); err != nil {
		return err
	}
	n.ino.Attr = a
	n.ino.xattr = encodeXattrs(x)
	return nil
}

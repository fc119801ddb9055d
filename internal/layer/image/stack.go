package image

import (
	"crypto/sha256"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"

	goerofs "github.com/erofs/go-erofs"
	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/dedup"
	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// chainIDs are the OCI chain IDs of layers with diffIDs, bottom first:
// a layer with everything under it. A converted layer depends on what
// is under it (a directory its tar only implies takes its attributes
// from there), so it is keyed by its chain, as Docker keys its layers.
func chainIDs(diffIDs []digest.Digest) []digest.Digest {
	out := make([]digest.Digest, len(diffIDs))
	for i, d := range diffIDs {
		if i == 0 {
			out[i] = d
			continue
		}
		out[i] = digest.NewDigestFromBytes(digest.SHA256, sum(out[i-1].String()+" "+d.String()))
	}
	return out
}

func sum(s string) []byte {
	h := sha256.Sum256([]byte(s))
	return h[:]
}

// stack is the layers under one being converted, topmost first: what a
// directory its tar only implies looks like below it, as overlayfs would
// show it (a whiteout, a file or an opaque directory above hides what is
// under it).
type stack struct {
	fss   []fs.FS
	files []*os.File
}

func openStack(s *store.Store, layers []digest.Digest) (*stack, error) {
	st := &stack{}
	for i := len(layers) - 1; i >= 0; i-- {
		f, devs, err := s.OpenLayer(layers[i])
		if err != nil {
			st.Close()
			return nil, err
		}
		st.files = append(append(st.files, f), devs...)
		readers := make([]io.ReaderAt, len(devs))
		for j, d := range devs {
			readers[j] = d
		}
		fsys, err := layer.OpenFS(f, readers...)
		if err != nil {
			st.Close()
			return nil, err
		}
		st.fss = append(st.fss, fsys)
	}
	return st, nil
}

func (st *stack) Close() {
	for _, f := range st.files {
		f.Close()
	}
}

// implied is the directory p as the stack shows it, if it is one.
func (st *stack) implied(p string) (erofs.Attr, bool) {
	name := p
	if name == "" {
		name = "."
	}
	for _, fsys := range st.fss {
		info, err := fs.Lstat(fsys, name)
		if err == nil {
			if !info.IsDir() {
				return erofs.Attr{}, false // a file, or a whiteout, hides it below
			}
			return dirAttr(info), true
		}
		if hides(fsys, name) {
			return erofs.Attr{}, false
		}
	}
	return erofs.Attr{}, false
}

// hides says whether a layer that lacks name hides it in the layers
// under it: an ancestor there is opaque, or no directory.
func hides(fsys fs.FS, name string) bool {
	for a := path.Dir(name); ; a = path.Dir(a) {
		if info, err := fs.Lstat(fsys, a); err == nil {
			if !info.IsDir() {
				return true
			}
			if st, ok := info.Sys().(*goerofs.Stat); ok && st.Xattrs[opaqueXattr] == "y" {
				return true
			}
		}
		if a == "." {
			return false
		}
	}
}

const opaqueXattr = "trusted.overlay.opaque"

// dirAttr is a directory's attributes as a layer above takes them: not
// overlayfs' own xattrs (an opaque directory stays opaque only where it
// is).
func dirAttr(info fs.FileInfo) erofs.Attr {
	st, _ := info.Sys().(*goerofs.Stat)
	if st == nil {
		return erofs.Attr{Mode: uint32(info.Mode().Perm()) | erofs.S_IFDIR}
	}
	a := dedup.AttrOf(st)
	a.Mode = a.Mode&^erofs.S_IFMT | erofs.S_IFDIR
	for k := range a.Xattrs {
		if strings.HasPrefix(k, "trusted.overlay.") {
			delete(a.Xattrs, k)
		}
	}
	return a
}

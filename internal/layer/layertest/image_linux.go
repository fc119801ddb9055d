package layertest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content/oci"
	"oras.land/oras-go/v2/registry/remote"
)

// Layout is an OCI image layout that images are built in with umoci,
// the reference tool: it writes the layers (whiteouts for what a layer
// deletes) and unpacks an image as a runtime would see it.
type Layout struct{ Dir string }

// NewLayout makes an empty layout at dir.
func NewLayout(dir string) (*Layout, error) {
	if _, err := exec.LookPath("umoci"); err != nil {
		return nil, fmt.Errorf("umoci is missing (make deps installs it): %w", err)
	}
	l := &Layout{Dir: dir}
	return l, l.Umoci("init", "--layout", dir)
}

// Umoci runs umoci.
func (l *Layout) Umoci(args ...string) error {
	if out, err := exec.Command("umoci", args...).CombinedOutput(); err != nil {
		return fmt.Errorf("umoci %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

// Layer adds a layer to the image tag, made from the image from (""
// none): change edits the unpacked root, and umoci repacks what changed.
func (l *Layout) Layer(from, tag string, change func(root string) error) error {
	var err error
	switch {
	case from == "":
		err = l.Umoci("new", "--image", l.Dir+":"+tag)
	case from != tag:
		err = l.Umoci("tag", "--image", l.Dir+":"+from, tag)
	}
	if err != nil {
		return err
	}
	tmp, err := os.MkdirTemp("", "bundle")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	bundle := filepath.Join(tmp, "b")
	if err := l.Umoci("unpack", "--image", l.Dir+":"+tag, bundle); err != nil {
		return err
	}
	if err := change(filepath.Join(bundle, "rootfs")); err != nil {
		return err
	}
	return l.Umoci("repack", "--image", l.Dir+":"+tag, bundle)
}

// Unpack unpacks the image tag into bundle as umoci does; its root is
// bundle/rootfs.
func (l *Layout) Unpack(tag, bundle string) error {
	return l.Umoci("unpack", "--image", l.Dir+":"+tag, bundle)
}

// Push copies the image tag to the registry at addr (plain HTTP) as
// repo:tag.
func (l *Layout) Push(addr, repo, tag string) error {
	src, err := oci.New(l.Dir)
	if err != nil {
		return err
	}
	dst, err := remote.NewRepository(addr + "/" + repo)
	if err != nil {
		return err
	}
	dst.PlainHTTP = true
	if _, err := oras.Copy(context.Background(), src, tag, dst, tag, oras.DefaultCopyOptions); err != nil {
		return fmt.Errorf("push %s:%s: %w", repo, tag, err)
	}
	return nil
}

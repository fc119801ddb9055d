package runtime

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"syscall"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
)

// Options describe a sandbox to create.
type Options struct {
	Name     string
	Layers   []string // refs, topmost first: toolkit, workspace, base
	Limits   cgroup.Limits
	Hostname string

	// Remote, if set, is where layers missing from the local store are
	// mounted from lazily, by fetchers started with Fetcher.
	Remote   remote.Target
	Insecure bool
	Fetcher  lazy.Start
	CacheMax int64 // the host cache budget (cache.max_bytes)
}

// State is what survives a worker restart, in <root>/sandboxes/NAME/state.json.
type State struct {
	Name    string    `json:"name"`
	Pid     int       `json:"pid"` // the init's host pid
	Layers  []string  `json:"layers"`
	Digests []string  `json:"digests"`
	Created time.Time `json:"created"`
}

// Sandbox is a created sandbox: its layers mounted, its overlay root, its
// cgroup and its init.
type Sandbox struct {
	State
	dir string
	c   *container.Sandbox
	g   *cgroup.Group
}

var nameRE = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}$`)

func sandboxDir(root, name string) string { return filepath.Join(root, "sandboxes", name) }

func cgroupName(name string) string { return "sb-" + name }

// Create composes the layers under an upper on local disk, makes the
// cgroup and starts the init. On any failure everything done so far is
// undone: no mount, cgroup or directory is left behind.
func Create(ctx context.Context, root string, s *store.Store, o Options) (_ *Sandbox, err error) {
	if !nameRE.MatchString(o.Name) {
		return nil, fmt.Errorf("bad sandbox name %q: use up to 63 letters, digits, '_', '.' and '-': %w", o.Name, errdefs.ErrInvalidArgument)
	}
	if len(o.Layers) == 0 {
		return nil, fmt.Errorf("a sandbox needs at least a base layer: %w", errdefs.ErrInvalidArgument)
	}
	dir := sandboxDir(root, o.Name)
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return nil, err
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		if errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("sandbox %s already exists: %w", o.Name, errdefs.ErrAlreadyExists)
		}
		return nil, err
	}
	sb := &Sandbox{State: State{Name: o.Name, Layers: o.Layers, Created: time.Now().UTC()}, dir: dir}
	defer func() {
		if err != nil {
			sb.teardown()
		}
	}()
	var lowers []string
	for i, ref := range o.Layers {
		mnt := filepath.Join(dir, "layers", fmt.Sprint(i))
		if err := os.MkdirAll(mnt, 0o700); err != nil {
			return nil, err
		}
		d, err := mountLayer(ctx, root, s, o, ref, mnt)
		if err != nil {
			return nil, err
		}
		lowers = append(lowers, mnt)
		sb.Digests = append(sb.Digests, d)
	}
	upper, work, rootfs := filepath.Join(dir, "upper"), filepath.Join(dir, "work"), filepath.Join(dir, "rootfs")
	for _, d := range []string{upper, work, rootfs} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return nil, err
		}
	}
	if err := mount.Overlay(lowers, upper, work).Mount(rootfs); err != nil {
		return nil, err
	}
	if sb.g, err = cgroup.New(cgroupName(o.Name), o.Limits); err != nil {
		return nil, err
	}
	logf, err := os.OpenFile(filepath.Join(dir, "init.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	hostname := o.Hostname
	if hostname == "" {
		hostname = o.Name
	}
	if sb.c, err = container.Create(container.Spec{Root: rootfs, Hostname: hostname, Socket: filepath.Join(dir, "init.sock"),
		Setup: sb.g.Add, Stdout: logf, Stderr: logf}); err != nil {
		return nil, err
	}
	sb.Pid = sb.c.Pid()
	b, _ := json.MarshalIndent(sb.State, "", "  ")
	if err := os.WriteFile(filepath.Join(dir, "state.json"), b, 0o600); err != nil {
		return nil, err
	}
	return sb, nil
}

// mountLayer mounts a layer from the local store, or lazily from the
// remote when the store lacks it, and returns its digest.
func mountLayer(ctx context.Context, root string, s *store.Store, o Options, ref, mnt string) (string, error) {
	info, err := layer.Resolve(ctx, s, ref)
	if err == nil {
		return info.Digest.String(), mount.EROFS(s.BlobPath(info.Digest)).Mount(mnt)
	}
	if !errdefs.IsNotFound(err) || o.Remote == nil {
		return "", err
	}
	r, err := layer.ParseRef(ref)
	if err != nil {
		return "", err
	}
	l, err := remote.Describe(ctx, o.Remote, r)
	if err != nil {
		return "", err
	}
	spec := lazy.Spec{Ref: r.String(), Digest: l.Blob.Digest, Size: l.Blob.Size, Metadata: l.Config.Metadata,
		Windows: l.Config.Windows, Remote: o.Remote.String(), Insecure: o.Insecure, MaxBytes: o.CacheMax}
	return l.Blob.Digest.String(), lazy.Mount(ctx, root, spec, l.Windows, mnt, o.Fetcher)
}

// Load re-adopts a sandbox a previous worker created.
func Load(root, name string) (*Sandbox, error) {
	dir := sandboxDir(root, name)
	b, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("no sandbox %s: %w", name, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	sb := &Sandbox{dir: dir}
	if err := json.Unmarshal(b, &sb.State); err != nil {
		return nil, fmt.Errorf("sandbox %s: state: %v: %w", name, err, errdefs.ErrDataLoss)
	}
	sb.g, _ = cgroup.Open(cgroupName(name))
	if sb.c, err = container.Attach(filepath.Join(dir, "init.sock"), sb.Pid); err != nil {
		return sb, err // the caller may still Remove what is left
	}
	return sb, nil
}

// Exec runs a command in the sandbox (see container.Sandbox.Exec).
func (sb *Sandbox) Exec(ctx context.Context, id string, args, env []string, cwd string, stdin, stdout, stderr *os.File) (int, error) {
	if sb.c == nil {
		return -1, container.ErrSandboxDied
	}
	return sb.c.Exec(ctx, id, args, env, cwd, stdin, stdout, stderr)
}

// Upper is the directory holding everything the sandbox wrote.
func (sb *Sandbox) Upper() string { return filepath.Join(sb.dir, "upper") }

// Cgroup is the sandbox's control group.
func (sb *Sandbox) Cgroup() *cgroup.Group { return sb.g }

// Close lets go of the sandbox, which keeps running.
func (sb *Sandbox) Close() error {
	if sb.c != nil {
		return sb.c.Close()
	}
	return nil
}

// Remove stops every process of the sandbox and removes its mounts,
// cgroup and state.
func (sb *Sandbox) Remove() error { return sb.teardown() }

func (sb *Sandbox) teardown() error {
	var errs []error
	if sb.c != nil {
		sb.c.Destroy()
	}
	if sb.g != nil {
		if err := sb.g.Kill(); err != nil {
			errs = append(errs, err)
		}
		if err := sb.g.Remove(); err != nil {
			errs = append(errs, err)
		}
	}
	for _, m := range []string{filepath.Join(sb.dir, "rootfs")} {
		if err := mount.Unmount(m); err != nil && !errors.Is(err, os.ErrNotExist) && !isNotMounted(err) {
			errs = append(errs, err)
		}
	}
	layers, _ := filepath.Glob(filepath.Join(sb.dir, "layers", "*"))
	for _, m := range layers {
		// lazy.Unmount also tells a lazy layer's fetcher it may go.
		if err := lazy.Unmount(m); err != nil && !isNotMounted(err) {
			errs = append(errs, err)
		}
	}
	if len(errs) == 0 {
		if err := os.RemoveAll(sb.dir); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func isNotMounted(err error) bool {
	return errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.ENOENT)
}

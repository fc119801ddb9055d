package worker

import (
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path"
	"strconv"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/backend"
)

// File operations on a sandbox's tree (list, mkdir, rename, remove), as
// its processes would resolve the paths (runtime.Sandbox.Files): never
// leading outside its root. What an agent does with them in a sandbox
// it could do itself; they exist for clients without a shell in it
// (the E2B front's envd).

// Bounds on a listing: entries, and depth below the directory.
const (
	maxDirEntries = 100000
	maxDirDepth   = 64
)

// sandboxPath is a request's path query: a clean absolute path, as the
// FS names it (relative to the root), and the files.
func (w *worker) sandboxPath(r *http.Request, key string) (string, error) {
	p := r.URL.Query().Get(key)
	if !path.IsAbs(p) {
		return "", fmt.Errorf("bad %s %q: give an absolute path in the sandbox: %w", key, p, errdefs.ErrInvalidArgument)
	}
	return path.Clean(p)[1:], nil
}

// withFiles runs fn on the files of the request's sandbox.
func (w *worker) withFiles(r *http.Request, fn func(e *entry, s backend.Files) error) error {
	e, err := w.get(r)
	if err != nil {
		return err
	}
	s, err := e.sb.Files()
	if err != nil {
		return err
	}
	defer s.Close()
	return fn(e, s)
}

func statOf(s backend.Files, name string, fi fs.FileInfo) api.PathStat {
	st := api.PathStat{Name: path.Base("/" + name), Mode: fi.Mode(), Size: fi.Size(), Mtime: fi.ModTime()}
	if fi.Mode()&fs.ModeSymlink != 0 {
		st.LinkTarget, _ = s.Readlink(name)
	}
	return st
}

// listDir lists a directory's entries, depth levels down (default 1).
func (w *worker) listDir(r *http.Request, _ none) ([]api.DirEntry, error) {
	p, err := w.sandboxPath(r, "path")
	if err != nil {
		return nil, err
	}
	depth := 1
	if d := r.URL.Query().Get("depth"); d != "" {
		if depth, err = strconv.Atoi(d); err != nil || depth < 1 || depth > maxDirDepth {
			return nil, fmt.Errorf("bad depth %q: give 1 to %d: %w", d, maxDirDepth, errdefs.ErrInvalidArgument)
		}
	}
	out := []api.DirEntry{}
	err = w.withFiles(r, func(e *entry, s backend.Files) error {
		fi, err := s.Stat(cleanName(p))
		if err != nil {
			return pathError(e.sb, "/"+p, err)
		}
		if !fi.IsDir() {
			return fmt.Errorf("/%s in sandbox %s is not a directory: %w", p, e.sb.Name, errdefs.ErrInvalidArgument)
		}
		var walk func(dir string, level int) error
		walk = func(dir string, level int) error {
			f, err := s.OpenFile(cleanName(dir), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NONBLOCK, 0)
			if err != nil {
				return pathError(e.sb, "/"+dir, err)
			}
			// Names only: os's DirEntry.Info would stat the name on the
			// host's side, outside the sandbox's resolution.
			names, err := f.Readdirnames(-1)
			f.Close()
			if err != nil {
				return pathError(e.sb, "/"+dir, err)
			}
			for _, n := range names {
				child := path.Join(dir, n)
				fi, err := s.Lstat(child)
				if err != nil {
					continue // gone meanwhile
				}
				if len(out) >= maxDirEntries {
					return fmt.Errorf("/%s in sandbox %s holds over %d entries: list less deep: %w", p, e.sb.Name, maxDirEntries, errdefs.ErrOutOfRange)
				}
				out = append(out, api.DirEntry{Path: "/" + child, PathStat: statOf(s, child, fi)})
				if fi.IsDir() && level < depth {
					if err := walk(child, level+1); err != nil {
						return err
					}
				}
			}
			return nil
		}
		return walk(p, 1)
	})
	return out, err
}

// cleanName is a path relative to the root as the FS takes it ("." for
// the root).
func cleanName(p string) string {
	if p == "" {
		return "."
	}
	return p
}

// makeDir makes a directory (with parents=1, its missing parents too)
// and describes it; one that exists is ErrAlreadyExists.
func (w *worker) makeDir(r *http.Request, _ none) (api.PathStat, error) {
	p, err := w.sandboxPath(r, "path")
	if err != nil {
		return api.PathStat{}, err
	}
	if p == "" {
		return api.PathStat{}, fmt.Errorf("/ exists: %w", errdefs.ErrAlreadyExists)
	}
	parents := r.URL.Query().Get("parents") == "1"
	var st api.PathStat
	err = w.withFiles(r, func(e *entry, s backend.Files) error {
		if _, err := s.Lstat(p); err == nil {
			return fmt.Errorf("/%s exists in sandbox %s: %w", p, e.sb.Name, errdefs.ErrAlreadyExists)
		}
		if parents {
			if err := mkdirAll(s, path.Dir(p)); err != nil {
				return pathError(e.sb, "/"+path.Dir(p), err)
			}
		}
		if err := s.Mkdir(p, 0o755); err != nil {
			if errors.Is(err, fs.ErrExist) {
				return fmt.Errorf("/%s exists in sandbox %s: %w", p, e.sb.Name, errdefs.ErrAlreadyExists)
			}
			return pathError(e.sb, "/"+p, err)
		}
		fi, err := s.Lstat(p)
		if err != nil {
			return pathError(e.sb, "/"+p, err)
		}
		st = statOf(s, p, fi)
		return nil
	})
	return st, err
}

// mkdirAll makes dir and its missing parents, top down.
func mkdirAll(s backend.Files, dir string) error {
	if dir == "." {
		return nil
	}
	if fi, err := s.Stat(dir); err == nil {
		if !fi.IsDir() {
			return &fs.PathError{Op: "mkdir", Path: "/" + dir, Err: unix.ENOTDIR}
		}
		return nil
	}
	if err := mkdirAll(s, path.Dir(dir)); err != nil {
		return err
	}
	if err := s.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	return nil
}

// renamePath moves path to to (replacing a file there, as rename(2)).
func (w *worker) renamePath(r *http.Request, _ none) (api.PathStat, error) {
	from, err := w.sandboxPath(r, "path")
	if err != nil {
		return api.PathStat{}, err
	}
	to, err := w.sandboxPath(r, "to")
	if err != nil {
		return api.PathStat{}, err
	}
	if from == "" || to == "" {
		return api.PathStat{}, fmt.Errorf("cannot move / or over it: %w", errdefs.ErrInvalidArgument)
	}
	var st api.PathStat
	err = w.withFiles(r, func(e *entry, s backend.Files) error {
		if err := s.Rename(from, to); err != nil {
			return pathError(e.sb, "/"+from, err)
		}
		fi, err := s.Lstat(to)
		if err != nil {
			return pathError(e.sb, "/"+to, err)
		}
		st = statOf(s, to, fi)
		return nil
	})
	return st, err
}

// removePath removes a file, a link or (recursive=1) a whole tree.
func (w *worker) removePath(r *http.Request, _ none) (none, error) {
	p, err := w.sandboxPath(r, "path")
	if err != nil {
		return none{}, err
	}
	if p == "" {
		return none{}, fmt.Errorf("cannot remove /: %w", errdefs.ErrInvalidArgument)
	}
	recursive := r.URL.Query().Get("recursive") == "1"
	return none{}, w.withFiles(r, func(e *entry, s backend.Files) error {
		fi, err := s.Lstat(p)
		if err != nil {
			return pathError(e.sb, "/"+p, err)
		}
		if fi.IsDir() && recursive {
			err = removeAll(s, p)
		} else {
			err = s.Remove(p)
		}
		if errors.Is(err, unix.ENOTEMPTY) || errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("/%s in sandbox %s is a directory that is not empty: remove it recursively: %w", p, e.sb.Name, errdefs.ErrFailedPrecondition)
		}
		if err != nil {
			return pathError(e.sb, "/"+p, err)
		}
		return nil
	})
}

// removeAll removes the tree at dir, depth first; a link is removed,
// never followed.
func removeAll(s backend.Files, dir string) error {
	f, err := s.OpenFile(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return err
	}
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return err
	}
	for _, n := range names {
		child := path.Join(dir, n)
		fi, err := s.Lstat(child)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		if fi.IsDir() {
			err = removeAll(s, child)
		} else {
			err = s.Remove(child)
		}
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return s.Remove(dir)
}

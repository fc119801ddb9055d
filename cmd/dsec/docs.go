//go:build gendocs && !front

package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"time"

	"github.com/invopop/jsonschema"
	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"

	"github.com/dsec-project/dsec/api"
)

// gen-docs lives behind the gendocs build tag (make docs builds bin/dsec-docs
// with it): its man page, markdown and schema generators cost the everyday
// binary ~1 ms of start-up in package initialisation alone.
func init() { extraCommands = append(extraCommands, (*app).docsCommand) }

// docsDate is the date printed in generated man pages. It is fixed so
// that regenerating the pages changes them only when the commands do.
var docsDate = time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)

// docsCommand writes man pages and shell completions from the command
// tree, the policy schema from the api types, and the references under
// docs/reference (docs_reference.go): the CLI's, the configuration's and
// the API's; `make docs` runs it and `make test` fails when its output
// differs from what is committed.
func (a *app) docsCommand() *cobra.Command {
	return &cobra.Command{
		Use:    "gen-docs DIR",
		Short:  "Write man pages to DIR/man, completions to DIR/completions, the policy schema and the references to DIR/docs",
		Hidden: true,
		Args:   exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			root := cmd.Root()
			root.DisableAutoGenTag = true
			// Defaults that depend on who runs this would make the pages
			// differ between machines: describe them instead.
			pf := root.PersistentFlags()
			pf.Lookup("root").DefValue = "/var/lib/dsec as root, $XDG_DATA_HOME/dsec otherwise"
			described := map[string]bool{"root": true}
			man := filepath.Join(args[0], "man", "man1")
			comp := filepath.Join(args[0], "completions")
			for _, d := range []string{man, comp} {
				if err := os.MkdirAll(d, 0o755); err != nil {
					return err
				}
			}
			hdr := &doc.GenManHeader{Title: "DSEC", Section: "1", Source: "dsec", Manual: "dsec manual", Date: &docsDate}
			if err := doc.GenManTree(root, hdr, man); err != nil {
				return fmt.Errorf("man pages: %w", err)
			}
			gens := map[string]func(string) error{
				"dsec.bash": func(p string) error { return root.GenBashCompletionFileV2(p, true) },
				"dsec.zsh":  root.GenZshCompletionFile,
				"dsec.fish": func(p string) error { return root.GenFishCompletionFile(p, true) },
			}
			for name, gen := range gens {
				if err := gen(filepath.Join(comp, name)); err != nil {
					return fmt.Errorf("completion %s: %w", name, err)
				}
			}
			if err := writeSchema(filepath.Join(args[0], "docs", "policy.schema.json")); err != nil {
				return err
			}
			ref := filepath.Join(args[0], "docs", "reference")
			if err := writeCLIReference(root, filepath.Join(ref, "cli")); err != nil {
				return err
			}
			if err := writeConfigReference(root, described, filepath.Join(ref, "config.md")); err != nil {
				return err
			}
			return writeAPIReference("api", filepath.Join(ref, "api.md"))
		},
	}
}

// writeSchema writes the JSON schema of policy documents, described from
// the api package's comments (gen-docs runs in the repository).
func writeSchema(path string) error {
	r := &jsonschema.Reflector{
		BaseSchemaID: "https://dsec.dev/schemas",
		Mapper: func(t reflect.Type) *jsonschema.Schema {
			if t != reflect.TypeFor[api.PortRange]() {
				return nil
			}
			return &jsonschema.Schema{
				Description: "a port, or an inclusive range of ports as \"LOW-HIGH\"",
				OneOf: []*jsonschema.Schema{
					{Type: "integer", Minimum: "1", Maximum: "65535"},
					{Type: "string", Pattern: `^[0-9]{1,5}-[0-9]{1,5}$`},
				},
			}
		},
	}
	if err := r.AddGoComments("github.com/dsec-project/dsec", "./api"); err != nil {
		return fmt.Errorf("policy schema: read the api package's comments (run gen-docs in the repository): %w", err)
	}
	s := r.Reflect(&api.Policy{})
	s.Title = "dsec policy (" + api.PolicyVersion + ")"
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}
